"""How one method is measured in one cell: first step, warm-up, timed steps, GPU-busy profile, graph count."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from packgraph.bench.methods import Method
from packgraph.bench.profiling import KernelProfile, gpu_busy_ms
from packgraph.graphs.memory import release_spare_pools
from packgraph.packing import PackedBatch

__all__ = ["Measurement", "measure", "release"]


@dataclass
class Measurement:
    """What :func:`measure` found for one method in one cell (times in ms unless named ``_s``)."""

    timer: str
    steps: int
    step_ms: float
    step_ms_p10: float
    step_ms_p90: float
    real_tokens_per_step: float
    first_step_s: float
    first_loss: float
    gpu_busy_ms: float | None
    gpu_copy_ms: float | None
    kernels_per_step: float | None
    busy_steps: int | None
    step_ms_busy_batches: float | None
    gpu_busy_by_class: dict[str, float] | None
    top_kernels: list[list[Any]] | None
    graphs: int | None
    graph_batches: int | None
    predicted_graphs: int | None
    recompiles: int | None
    peak_mem_mib: float | None
    peak_mem_timed_mib: float | None
    peak_reserved_mib: float | None
    peak_requested_mib: float | None
    elapsed_s: float
    extra: dict[str, Any]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


class _Inputs:
    """``method.prepare`` of the batches of ``stream``, each made once: the timed pool's up front (the timed loop
    then indexes :attr:`prepared`, a plain dict), the graph-count batches' on first use."""

    def __init__(self, method: Method, stream: Sequence[PackedBatch], pool: int) -> None:
        self.method, self.stream = method, stream
        self.prepared = {i: method.prepare(stream[i]) for i in range(pool)}

    def __getitem__(self, i: int) -> Any:
        if i not in self.prepared:
            self.prepared[i] = self.method.prepare(self.stream[i])
        return self.prepared[i]

    def step(self, i: int) -> None:
        self.method.step(self[i])


def _mib(nbytes: int) -> float:
    return nbytes / 2**20


def _first_step(method: Method, inputs: _Inputs) -> tuple[float, float]:
    """``(seconds, loss)`` of the step on batch 0, capture or compilation included; starts the peak-memory window."""
    device = method.device
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    inputs.step(0)
    _sync(device)
    return time.perf_counter() - t0, float(method.last_loss)


def _warm_up(method: Method, inputs: _Inputs, pool: int, warmup: int) -> None:
    warm = range(1, pool) if method.warm_pool else range(1, 1 + warmup)
    for i in warm:
        inputs.step(i % pool)
    _sync(method.device)


def _timed_steps(method: Method, inputs: Mapping[int, Any], order: Sequence[int]) -> list[float]:
    """ms of each step of ``order`` (indices of the prepared pool): CUDA events on CUDA, ``perf_counter``
    elsewhere."""
    device = method.device
    if device.type != "cuda":
        times = []
        for i in order:
            t = time.perf_counter()
            method.step(inputs[i])
            times.append((time.perf_counter() - t) * 1e3)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in order]
    for i, (start, end) in zip(order, events, strict=True):
        start.record()
        method.step(inputs[i])
        end.record()
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def _profile(
    method: Method, inputs: Mapping[int, Any], order: Sequence[int], times: Sequence[float], k: int
) -> tuple[KernelProfile, float]:
    """The kernel profile of batches ``0..k-1`` of the pool, and the mean of their timed steps (the median of each
    batch's steps): step/busy then compares the same batches."""
    kernels = gpu_busy_ms(lambda i: method.step(inputs[i]), steps=k)
    per_batch: dict[int, list[float]] = {}
    for i, t in zip(order, times, strict=True):
        per_batch.setdefault(i, []).append(t)
    return kernels, statistics.fmean(statistics.median(per_batch[i]) for i in range(k))


def _count_graphs(
    method: Method, inputs: _Inputs, pool: int, graph_batches: int, graph_budget_s: float
) -> tuple[int | None, int, int]:
    """``(graphs, batches seen, predicted graphs)`` after running the stream on from the pool's end."""
    seen = pool
    deadline = time.perf_counter() + graph_budget_s
    while seen < min(graph_batches, len(inputs.stream)) and time.perf_counter() < deadline:
        inputs.step(seen)
        seen += 1
    _sync(method.device)
    return method.graphs(), seen, len({method.signature(b) for b in inputs.stream[:seen]})


def _kernel_fields(kernels: KernelProfile | None) -> dict[str, Any]:
    """The :class:`Measurement` fields of a kernel profile (all None without one)."""
    return dict(
        gpu_busy_ms=kernels.busy_ms if kernels else None,
        gpu_copy_ms=kernels.copy_ms if kernels else None,
        kernels_per_step=kernels.kernels if kernels else None,
        busy_steps=kernels.steps if kernels else None,
        gpu_busy_by_class=kernels.by_class if kernels else None,
        top_kernels=kernels.top if kernels else None,
    )


def measure(
    method: Method,
    stream: Sequence[PackedBatch],
    *,
    steps: int,
    warmup: int,
    graph_batches: int,
    graph_budget_s: float,
    profile: bool = True,
    profile_steps: int = 8,
) -> Measurement:
    """Measure ``method`` on ``stream`` (host batches; needs ``len(stream) >= steps``).

    Phases, in order:

    1. **first step** on ``stream[0]``, wall clock including capture/compilation (``first_step_s``);
    2. **warm-up**: methods with a per-signature cache (graphs, compilation) run every batch of the timed pool
       ``stream[:steps]`` once, so the timed loop replays; the others run ``warmup`` steps;
    3. **timed**: ``steps`` steps over the pool, each timed with CUDA events (``perf_counter`` on CPU); the
       median is ``step_ms``;
    4. **profile** (CUDA): the first ``profile_steps`` batches of the pool again, under ``torch.profiler``:
       ``gpu_busy_ms`` is their kernel time per step, ``step_ms_busy_batches`` the mean timed step of the same
       batches, so that step/busy compares like with like (a pool mixes buckets, each with its own kernel time);
    5. **graph count** (cache methods): continue over ``stream[steps:graph_batches]`` within
       ``graph_budget_s`` seconds; ``graphs`` is what the method recorded over the ``graph_batches`` batches
       it saw, ``predicted_graphs`` the distinct host signatures among them.
    """
    device = method.device
    cuda = device.type == "cuda"
    pool = min(steps, len(stream))
    if pool < 1:
        raise ValueError("measure needs steps >= 1 and a non-empty stream")
    started = time.perf_counter()
    inputs = _Inputs(method, stream, pool)  # inputs live on the device before any timing
    first_step_s, first_loss = _first_step(method, inputs)
    _warm_up(method, inputs, pool, warmup)

    order = [i % pool for i in range(steps)]
    times = _timed_steps(method, inputs.prepared, order)
    real_tokens = statistics.fmean(sum(stream[i].doc_lengths) for i in order)
    peak_timed = _mib(torch.cuda.max_memory_allocated(device)) if cuda else None

    kernels = step_busy_batches = None
    if cuda and profile:
        kernels, step_busy_batches = _profile(method, inputs.prepared, order, times, min(profile_steps, pool))

    graphs = graph_batches_seen = predicted = None
    if method.counts_graphs:
        graphs, graph_batches_seen, predicted = _count_graphs(method, inputs, pool, graph_batches, graph_budget_s)
    peak = _mib(torch.cuda.max_memory_allocated(device)) if cuda else None
    # Reserved counts what tensors do not: graph-pool memory that is free between captures, allocator caching.
    peak_reserved = _mib(torch.cuda.max_memory_reserved(device)) if cuda else None
    # Requested counts tensors at the sizes asked for; allocated counts the blocks that held them, which are larger
    # by up to 1 MiB each where the allocator hands out a cached block without splitting it.
    peak_requested = _peak_requested_mib(device) if cuda else None
    return Measurement(
        timer="cuda-events" if cuda else "perf-counter",
        steps=len(times),
        step_ms=statistics.median(times),
        step_ms_p10=_quantile(times, 0.1),
        step_ms_p90=_quantile(times, 0.9),
        real_tokens_per_step=real_tokens,
        first_step_s=first_step_s,
        first_loss=first_loss,
        step_ms_busy_batches=step_busy_batches,
        graphs=graphs,
        graph_batches=graph_batches_seen,
        predicted_graphs=predicted,
        recompiles=method.recompiles(),
        peak_mem_mib=peak,
        peak_mem_timed_mib=peak_timed,
        peak_reserved_mib=peak_reserved,
        peak_requested_mib=peak_requested,
        elapsed_s=time.perf_counter() - started,
        extra=method.extra(),
        **_kernel_fields(kernels),
    )


def _peak_requested_mib(device: torch.device) -> float | None:
    """Peak of the bytes tensors asked for (the allocator's ``requested_bytes``), None where torch lacks it."""
    peak = torch.cuda.memory_stats(device).get("requested_bytes.all.peak")
    return _mib(peak) if peak is not None else None


def release(device: torch.device) -> None:
    """Free what a finished method left behind (call after dropping every reference to it).

    Never raises: after a device-side fault the context is unusable and every later method records that
    error instead of this cleanup ending the run.
    """
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
            # cuBLAS keeps a workspace per (thread's handle, stream) it has run on (32 MiB each on an H200), held
            # until cleared: without this a method's peak would count the workspaces of the methods before it.
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            # the memory pools the finished method's chained grad buffers left for reuse: the next method's peak
            # reserved memory would count them
            release_spare_pools()
            torch.cuda.empty_cache()
        except Exception:  # a poisoned CUDA context: let the next method report it
            pass
