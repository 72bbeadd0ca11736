"""GPU-busy time of training steps under ``torch.profiler``: kernel time per step, split by kernel class."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["KERNEL_CLASSES", "KernelProfile", "gpu_busy_ms", "kernel_class", "short_kernel_name"]

KERNEL_CLASSES: tuple[tuple[str, str], ...] = (
    ("attention bwd", r"flash.*(bwd|backward)|(bwd|backward).*flash|fmha.*bwd"),
    ("attention fwd", r"flash|fmha"),
    ("optimizer", r"adam"),
    ("foreach (grad buffers)", r"multi_tensor"),
    ("gemm", r"gemm|cutlass|nvjet|cublas|xmma|sm\d+_.*(tn|nt|nn|tt)"),
    ("inductor (triton)", r"^triton_"),
    ("reduction", r"reduce|norm|softmax|cross_entropy|nll_loss|sum_"),
    ("elementwise", r"elementwise|vectorized|unrolled|fill|copy|cat_|index|gather|scatter|embedding"),
    ("memcpy/memset", r"^(memcpy|memset)"),
)
"""``(class, regex)`` pairs, first match wins (case-insensitive): how :func:`gpu_busy_ms` groups kernel time, so
that two methods' GPU-busy times can be compared class by class. Anything else is ``"other"``."""

_CLASS_PATTERNS = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in KERNEL_CLASSES]


_NOISE = re.compile(r"\bvoid |\(anonymous namespace\)::|at::native::|at::cuda::|pytorch_flash::|cutlass::")


def short_kernel_name(name: str, limit: int = 160) -> str:
    """``name`` without the namespaces that make kernel names long, cut at ``limit`` characters."""
    return _NOISE.sub("", name)[:limit]


def kernel_class(name: str) -> str:
    """The :data:`KERNEL_CLASSES` class of a device activity named ``name`` (``"other"`` if none matches)."""
    return next((cls for cls, pattern in _CLASS_PATTERNS if pattern.search(name)), "other")


@dataclass
class KernelProfile:
    """Device time of some steps under ``torch.profiler``, per step (ms): kernels, copies/memsets, by class.

    ``busy_ms`` sums kernel durations (kernels inside CUDA graph replays included, as CUPTI reports them);
    ``copy_ms`` the memcpy/memset activities, which ``busy_ms`` excludes. ``kernels`` counts the kernels per
    step (copies excluded): with ``step / busy`` it tells the idle time per kernel boundary, the launch gaps a
    CUDA graph still has between its kernels. ``by_class`` splits the times by :func:`kernel_class`; ``top``
    lists the ``[name, ms]`` of the heaviest kernels (:func:`short_kernel_name`).
    """

    steps: int
    busy_ms: float
    copy_ms: float
    kernels: float
    by_class: dict[str, float]
    top: list[list[Any]]


def gpu_busy_ms(fn: Callable[[int], None], steps: int = 1, top: int = 12) -> KernelProfile:
    """Run ``fn(0) .. fn(steps - 1)`` under ``torch.profiler`` and return their device time per step.

    Device activity only. The kernel records are the same as with host activity, but a host+device profile
    also lists each ``record_function`` range as a device event spanning its kernels (AdamW's
    ``Optimizer.step#AdamW.step``, say: docs/bench.md), which a sum over device events counts on top of those
    kernels. Leaving out the host ops (thousands per eager step) also saves the seconds the
    profiler spends building their event tree.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    # One profiling cycle, read after it ends: acc_events keeps its events for that read (without it torch warns,
    # at the read, that a cycle's events are cleared).
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        for i in range(steps):
            fn(i)
        torch.cuda.synchronize()
    by_name: dict[str, float] = {}
    count: dict[str, int] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            by_name[event.name] = by_name.get(event.name, 0.0) + event.time_range.elapsed_us() / 1e3 / steps
            count[event.name] = count.get(event.name, 0) + 1
    by_class: dict[str, float] = {}
    kernels = 0
    for name, ms in by_name.items():  # classified once per name (an eager step has ~2000 kernels, ~70 names)
        cls = kernel_class(name)
        by_class[cls] = by_class.get(cls, 0.0) + ms
        kernels += count[name] if cls != "memcpy/memset" else 0
    copies = by_class.get("memcpy/memset", 0.0)
    heaviest = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return KernelProfile(
        steps=steps,
        busy_ms=sum(by_name.values()) - copies,
        copy_ms=copies,
        kernels=kernels / steps,
        by_class=dict(sorted(by_class.items(), key=lambda kv: -kv[1])),
        top=[[short_kernel_name(name), ms] for name, ms in heaviest],
    )
