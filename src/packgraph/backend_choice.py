"""Which attention backend a layer shape runs fastest on this device, measured (``attention_backend="auto"``).

:func:`choose_attention_backend` times ``varlen_attention``'s forward and backward on each backend, as a CUDA graph
replays it, over a few packings of ``T`` rows, and returns the faster backend with the bucket policy it needs:
``"flash"`` (FlashAttention-2) with :func:`~packgraph.buckets.default_buckets`, or ``"doc_mask"`` (FlexAttention's
document mask) with :func:`~packgraph.buckets.document_mask_buckets`, one graph for every packing. Neither wins
everywhere: on the H200 (torch 2.11) the document mask was faster at head size 128 in every measured cell and
slower at 64 in most (``bench/results/2026-12-03-h200-backends-partial/``). The choice is made once, before any
capture, on the caller's own device and shapes.

.. warning:: Measuring compiles the document mask for this shape (seconds, once per process) and runs on the
   current CUDA stream; call it before capturing, never inside a capture.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from packgraph.buckets import BucketPolicy, default_buckets, document_mask_buckets
from packgraph.ops import varlen_attention
from packgraph.params import PackedSeqParams

__all__ = ["BackendChoice", "capture_graph", "choose_attention_backend", "graph_replay_ms", "sample_packings"]

POLICIES: dict[str, Callable[[int], BucketPolicy]] = {"flash": default_buckets, "doc_mask": document_mask_buckets}


@dataclass(frozen=True)
class BackendChoice:
    """The chosen ``backend``, its bucket ``policy``, and what was measured: forward+backward ms per backend (the
    sum of each packing's median), or ``{}`` when nothing needed measuring (see ``reason``)."""

    backend: str
    policy: BucketPolicy
    times_ms: dict[str, float] = field(default_factory=dict)
    reason: str = "measured"


def sample_packings(total_tokens: int) -> list[list[int]]:
    """Document lengths of three packings of ``total_tokens`` rows that span what a layer meets: one document,
    four, and documents of 64 tokens (a short-document corpus)."""
    quarter = max(total_tokens // 4, 1)
    return [[total_tokens], [quarter] * (total_tokens // quarter), [64] * max(total_tokens // 64, 1)]


def choose_attention_backend(
    total_tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    packings: Sequence[Sequence[int]] | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    reps: int = 10,
) -> BackendChoice:
    """The faster of ``varlen_attention``'s backends for causal self-attention of ``[T, heads, head_dim]`` queries
    over ``kv_heads`` key/value heads, with the bucket policy that backend needs.

    Each backend runs forward+backward on each packing (``packings``: document lengths, each summing to at most
    ``total_tokens``; :func:`sample_packings` by default) under its own policy, timed as the median of ``reps``
    CUDA-graph replays; the smaller sum wins. On the CPU nothing is measured: ``"flash"`` (the document mask has no
    CPU backward in torch).

    Raises:
        ValueError: a packing longer than ``total_tokens``, or shapes ``varlen_attention`` refuses.
        RuntimeError: called during a CUDA graph capture.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return BackendChoice("flash", default_buckets(total_tokens), reason="cpu: the document mask has no backward")
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("choose_attention_backend measures by capturing graphs of its own: call it before capture")
    packings = [list(p) for p in (packings or sample_packings(total_tokens))]
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(total_tokens, heads, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()
    k, v = (
        torch.randn(total_tokens, kv_heads, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()
        for _ in "kv"
    )
    grad_out = torch.randn_like(q)
    times: dict[str, float] = {}
    for backend, policy_for in POLICIES.items():
        policy = policy_for(total_tokens)
        total = 0.0
        for lengths in packings:
            params = policy.apply(PackedSeqParams.from_seqlens(lengths, total_tokens=total_tokens, device=device))

            def step(params: PackedSeqParams = params, backend: str = backend) -> None:
                out = varlen_attention(q, k, v, params, window=window, softcap=softcap, backend=backend)
                torch.autograd.grad(out, (q, k, v), grad_out)

            total += statistics.median(graph_replay_ms(step, device, reps=reps))
        times[backend] = total
    best = min(times, key=times.__getitem__)
    return BackendChoice(best, POLICIES[best](total_tokens), times)


def capture_graph(fn: Callable[[], object], device: torch.device, *, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``fn()``, replayed ``max(warmup, 1)`` times. ``fn`` runs as often eagerly on a side stream
    first, so that lazy initialisation (and torch.compile) stays out of the capture."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(max(warmup, 1)):
        graph.replay()
    return graph


def graph_replay_ms(fn: Callable[[], object], device: torch.device, *, reps: int, warmup: int = 2) -> list[float]:
    """Milliseconds of each of ``reps`` replays of a CUDA graph of ``fn()`` (:func:`capture_graph`), timed with
    CUDA events."""
    graph = capture_graph(fn, device, warmup=warmup)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize(device)
    times = [start.elapsed_time(end) for start, end in events]
    del graph
    return times
