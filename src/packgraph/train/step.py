"""The parts of one optimizer step: forward and backward with gradient accumulation, the optimizer and its
learning-rate schedule, and the deterministic-kernels mode."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from packgraph.models.gpt import GPT
from packgraph.packing import PackedBatch
from packgraph.train.config import TrainConfig

__all__ = ["accumulate_gradients", "deterministic_kernels", "lr_factor", "make_optimizer"]


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at 0-based ``step``: linear warm-up to 1 over ``warmup`` steps, then cosine to
    ``min_ratio`` at ``total - 1``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: GPT, cfg: TrainConfig) -> torch.optim.AdamW:
    """Fused AdamW: weight decay on the matrices (parameters of 2 dims or more), none on the rest."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # fused (a kernel on both CPU and CUDA): its step counters live beside the parameters and it reads none of
    # them on the host, so the optimizer adds no sync to a step.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), fused=True)


def _autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    if device.type != "cuda" or not enabled:
        return contextlib.nullcontext()
    # cache_enabled=False: cast weights cached across a graph capture would be freed when autocast exits while
    # the graph still reads them (the rule torch.cuda.make_graphed_callables documents).
    return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)


def accumulate_gradients(
    model: torch.nn.Module,
    micro_batches: Sequence[PackedBatch],
    device: torch.device,
    *,
    autocast: bool = True,
    total_targets: int | None = None,
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> Tensor:
    """Forward and backward every micro-batch, accumulating into ``.grad``; return the step's loss (detached).

    Micro-batch ``i``'s mean loss is weighted by ``n_i / N`` (``n_i`` = its real target tokens, a host int; ``N``
    = ``total_targets``, default ``sum(n_i)``), so the accumulated gradient and the returned loss are those of the
    mean CE over all the step's targets: one big batch. Under data parallelism ``N`` is the count over every
    rank's micro-batches and the ranks' results sum to the global mean. ``model`` is a :class:`GPT`, a graphed
    wrapper, or DDP around either, with ``no_sync`` its ``no_sync`` (every micro-batch but the last runs under it,
    so DDP reduces once a step); each micro-batch finishes its backward before the next forward (graph buffers
    are reused).
    """
    targets = [b.num_real_tokens for b in micro_batches]
    total = max(sum(targets) if total_targets is None else total_targets, 1)
    step_loss = torch.zeros((), device=device)
    last = len(micro_batches) - 1
    for i, (batch, n) in enumerate(zip(micro_batches, targets, strict=True)):
        batch = batch.to(device)
        with no_sync() if no_sync is not None and i < last else contextlib.nullcontext():
            with _autocast(device, autocast):
                _, loss = model(batch)
            weight = n / total
            (loss * weight).backward()
        step_loss = step_loss + loss.detach().float() * weight
    return step_loss


@contextlib.contextmanager
def deterministic_kernels(enabled: bool) -> Iterator[None]:
    """Within the block, kernels are bitwise reproducible (``torch.use_deterministic_algorithms(True)``).

    This matters on CUDA: FlashAttention's backward then accumulates ``dq`` without atomics, and cuBLAS gets a fixed
    workspace (``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless set; read when a cuBLAS handle is created, so set it
    before the process's first matmul for a guarantee). An op with no deterministic kernel raises. The previous
    mode is restored on exit.
    """
    if not enabled:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
