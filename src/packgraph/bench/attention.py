"""Attention micro-benchmark: varlen attention forward+backward under static ``(max_seqlen, capacity)`` choices.

A graph bakes in ``max_seqlen`` and the capacity (the ``cu_seqlens`` shape); FlashAttention sizes its launch grid
from both (``ceil(max_seqlen / block) x capacity x heads`` blocks, the unused ones exit at once). This module
measures what that costs on real packings: for each packing, :func:`packgraph.ops.varlen_attention` fwd+bwd at

* ``max_seqlen`` in {true max, every power-of-two rung (>= 64) above it, every default-ladder rung above it, T};
* capacity in {true count, 8, 32, 128, 512, every default-ladder rung} (those that fit),

and reports each time as a ratio to (true max, true count), the eager choice. :func:`evaluate_ladders` then
replays candidate bucket ladders over the measured packings (each batch takes the smallest rung that fits) and
:func:`recommend_ladder` picks the one with the fewest buckets whose worst ratio stays within a limit.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from packgraph import slot_boundary
from packgraph.backend_choice import graph_replay_ms
from packgraph.bench.data import batch_stream
from packgraph.buckets import BucketPolicy, default_buckets, geometric_ladder
from packgraph.ops import varlen_attention
from packgraph.params import PackedSeqParams

__all__ = [
    "attention_benchmark",
    "attention_grid",
    "candidate_ladders",
    "evaluate_ladders",
    "recommend_ladder",
    "median_ms",
    "time_attention",
]

CAPACITY_RUNGS: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512)


def attention_grid(true_max: int, num_seqs: int, T: int, policy: BucketPolicy) -> tuple[list[int], list[int]]:
    """``(max_seqlens, capacities)`` to measure for one packing (see the module docstring)."""
    seqlens = {max(true_max, 1), T}
    rung = 64
    while rung < T:
        if rung >= true_max:
            seqlens.add(rung)
        rung *= 2
    seqlens |= {r for r in policy.max_seqlen_ladder if true_max <= r <= T}
    capacities = {num_seqs} | {c for c in (*CAPACITY_RUNGS, *policy.capacity_ladder) if c >= num_seqs}
    return sorted(seqlens), sorted(capacities)


def time_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: PackedSeqParams, *, reps: int, warmup: int = 2
) -> float:
    """Median ms of one ``varlen_attention`` forward + backward (``autograd.grad`` w.r.t. q, k, v).

    On CUDA: replays of a CUDA graph of the region, timed with CUDA events. On the CPU: ``perf_counter``.
    """
    grad_out = torch.ones_like(q)

    def once() -> None:
        out = varlen_attention(q, k, v, params, causal=True)
        torch.autograd.grad(out, (q, k, v), grad_out)

    return median_ms(once, q.device, reps=reps, warmup=warmup)


def median_ms(fn: Callable[[], object], device: torch.device, *, reps: int, warmup: int = 2) -> float:
    """Median ms of ``fn()``: on CUDA, of replays of a CUDA graph of it (CUDA events); on the CPU, ``perf_counter``.

    A graph is what packgraph runs: launched eagerly, an attention region of about 1 ms is host-bound (a few dozen
    small kernels), so eager timings would measure Python, not the kernels' grid cost.
    """
    if device.type == "cuda":
        return statistics.median(graph_replay_ms(fn, device, reps=reps, warmup=warmup))
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def attention_benchmark(
    T_values: Sequence[int],
    mixes: Sequence[str],
    head_dims: Sequence[int],
    *,
    heads: int = 16,
    packings: int = 8,
    reps: int = 10,
    seed: int = 0,
    device: torch.device | str = "cuda",
    max_corpus_docs: int | None = None,
    on_packing: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Measure every grid point of ``packings`` packings per (T, mix, head_dim); one row per point.

    Rows: ``T, mix, head_dim, heads, packing, num_seqs, true_max, max_seqlen, capacity, ms, ratio`` where
    ``ratio = ms / ms(true max, true count)`` of the same packing. bf16 on CUDA (FlashAttention-2), float32 on
    the CPU (the exact reference). ``on_packing`` is called after each packing (progress).
    """
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows: list[dict[str, Any]] = []
    gen = torch.Generator(device=device).manual_seed(seed)
    for T in T_values:
        policy = default_buckets(T)
        for mix in mixes:
            stream = batch_stream(mix, T, packings, seed=seed + 7, max_corpus_docs=max_corpus_docs)
            for head_dim in head_dims:
                q, k, v = (
                    torch.randn(T, heads, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()
                    for _ in range(3)
                )
                for index, batch in enumerate(stream):
                    lengths = list(batch.doc_lengths)
                    true_max, num_seqs = max(lengths), len(lengths)
                    seqlens, capacities = attention_grid(true_max, num_seqs, T, policy)
                    points = []
                    for max_seqlen in seqlens:
                        for capacity in capacities:
                            params = PackedSeqParams.from_seqlens(
                                lengths, capacity=capacity, total_tokens=T, max_seqlen=max_seqlen, device=device
                            )
                            ms = time_attention(q, k, v, params, reps=reps)
                            points.append(dict(max_seqlen=max_seqlen, capacity=capacity, ms=ms))
                    # the reference point is measured first; measure it again last and keep the faster, so
                    # clock ramp-up or drift during the sweep cannot flatter or penalise the other points
                    exact = PackedSeqParams.from_seqlens(
                        lengths, capacity=num_seqs, total_tokens=T, max_seqlen=true_max, device=device
                    )
                    again = time_attention(q, k, v, exact, reps=reps)
                    for p in points:
                        if (p["max_seqlen"], p["capacity"]) == (true_max, num_seqs):
                            p["ms"] = base = min(p["ms"], again)
                    for p in points:
                        rows.append(
                            dict(
                                T=T,
                                mix=mix,
                                head_dim=head_dim,
                                heads=heads,
                                packing=index,
                                num_seqs=num_seqs,
                                true_max=true_max,
                                **p,
                                ratio=p["ms"] / base,
                            )
                        )
                    if on_packing is not None:
                        on_packing()
    return rows


def candidate_ladders(
    T: int, short_docs_min_slots: int | None = slot_boundary.DEFAULT_MIN_SLOTS
) -> list[tuple[str, BucketPolicy]]:
    """Bucket policies to replay over the measurements: max_seqlen ladders x capacity ladders, plus the
    current :func:`~packgraph.buckets.default_buckets`; each with the short_docs switch ``short_docs_min_slots``
    (whose boundary rung it adds)."""

    seqlen_ladders = {
        "T": (T,),
        "x4 from 256": geometric_ladder(256, T, 4),
        "x2 from 1024": geometric_ladder(1024, T, 2),
        "x2 from 256": geometric_ladder(256, T, 2),
        "x2 from 128": geometric_ladder(128, T, 2),
        "x2 from 64": geometric_ladder(64, T, 2),
    }
    capacity_ladders = {
        "x2 from 8": CAPACITY_RUNGS,
        "x2 from 16": tuple(c for c in CAPACITY_RUNGS if c >= 16),
        "x4 from 8": (8, 32, 128, 512),
        "32,512": (32, 512),
        "512": (512,),
    }
    out = [("default", dataclasses.replace(default_buckets(T), short_docs_min_slots=short_docs_min_slots))]
    for s_name, s in seqlen_ladders.items():
        for c_name, c in capacity_ladders.items():
            caps = tuple(sorted({min(x, T) for x in c}))
            policy = BucketPolicy(s, caps, short_docs_min_slots=short_docs_min_slots)
            out.append((f"max_seqlen {s_name} / capacity {c_name}", policy))
    return out


def evaluate_ladders(
    rows: Iterable[dict[str, Any]], short_docs_min_slots: int | None = slot_boundary.DEFAULT_MIN_SLOTS
) -> list[dict[str, Any]]:
    """Replay :func:`candidate_ladders` (with ``short_docs_min_slots``) over measured rows: per (T, candidate), the
    bucket count and the worst and mean attention-time ratio vs eager's (true max, true count), over every packing,
    mix and head_dim.

    A candidate that cannot hold some packing, or whose bucket was not measured, reports ``missing > 0``.
    """
    by_point: dict[tuple, float] = {}
    packings: dict[tuple, tuple[int, int]] = {}
    for r in rows:
        key = (r["T"], r["mix"], r["head_dim"], r["packing"])
        by_point[(*key, r["max_seqlen"], r["capacity"])] = r["ratio"]
        packings[key] = (r["true_max"], r["num_seqs"])
    out = []
    for T in sorted({key[0] for key in packings}):
        for name, policy in candidate_ladders(T, short_docs_min_slots):
            ratios, per_mix, missing = [], {}, 0
            for key, (true_max, num_seqs) in packings.items():
                if key[0] != T:
                    continue
                try:
                    bucket = policy.bucket_for(true_max, num_seqs)
                except ValueError:
                    missing += 1
                    continue
                ratio = by_point.get((*key, bucket.max_seqlen, bucket.capacity))
                if ratio is None:
                    missing += 1
                    continue
                ratios.append(ratio)
                per_mix[key[1]] = max(per_mix.get(key[1], 0.0), ratio)
            out.append(
                dict(
                    T=T,
                    ladder=name,
                    max_seqlen_ladder=list(policy.max_seqlen_ladder),
                    capacity_ladder=list(policy.capacity_ladder),
                    buckets=policy.num_buckets,
                    worst_ratio=max(ratios) if ratios else None,
                    mean_ratio=statistics.fmean(ratios) if ratios else None,
                    worst_ratio_by_mix=per_mix,
                    packings=len(ratios),
                    missing=missing,
                )
            )
    return out


def recommend_ladder(summary: Iterable[dict[str, Any]], limit: float = 1.10) -> dict[int, dict[str, Any] | None]:
    """Per T: the evaluated candidate with the fewest buckets whose worst ratio is ``<= limit`` (ties: the lower
    mean ratio); None when no candidate qualifies."""
    best: dict[int, dict[str, Any] | None] = {}
    for s in summary:
        best.setdefault(s["T"], None)
        if s["missing"] or s["worst_ratio"] is None or s["worst_ratio"] > limit:
            continue
        current = best[s["T"]]
        if current is None or (s["buckets"], s["mean_ratio"]) < (current["buckets"], current["mean_ratio"]):
            best[s["T"]] = s
    return best
