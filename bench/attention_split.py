"""Varlen attention split two ways, timed against one FA2 call at the bucket and at the batch's true shape (GPU).

    python3 bench/attention_split.py [--T 2048] [--min-capacity 1] [--reps 20] [--out DIR]

A question for ``docs/buckets.md`` (last section), answered before anything is built into ``packgraph.ops``:
FlashAttention's grid has a block per 128 rows of ``max_seqlen`` per slot, and the bucket tour's large buckets
are mostly many short documents beside one long one. For each distinct bucket of the tour stream (``batch_stream``,
201 batches, default ladder) with at least ``--min-capacity`` slots, it times the forward and backward of:

* ``eager``: one FA2 call at the batch's true max_seqlen and document count;
* ``bucket``: one FA2 call at the bucket;
* ``split``: :func:`split_attention` at the bucket, the other documents at the ladder's rung above the
  second-longest one;
* ``short_docs``: :mod:`packgraph.ops.short_docs` at the bucket (short documents in local blocks, long ones in
  one FA2 call of few slots), and ``eager_short_docs`` at the true shape.

"One FA2 call" is ``varlen_attention`` with ``SHORT_DOCS_MIN_SLOTS`` set to None (off), and ``short_docs`` the
same with it at 1.
Each method's backward peak (allocated above its inputs, one eager call) is reported too.

Times are medians of CUDA-graph replays (:func:`packgraph.bench.attention.graph_replay_ms`), all measured
side by side on the same packing. Each split's outputs and grads are checked against the bucket call's first (the
largest difference is reported, and a NaN fails the run). On the CPU both run the exact reference, which ignores
max_seqlen: that checks the split's bookkeeping, not FlashAttention's.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch
from torch import Tensor

from packgraph import slot_boundary
from packgraph.bench.attention import graph_replay_ms
from packgraph.bench.data import batch_stream
from packgraph.bench.machine import machine_info
from packgraph.bench.report import write_table
from packgraph.buckets import default_buckets
from packgraph.ops import varlen_attention
from packgraph.ops.attention import _ZeroDeadRowGrad
from packgraph.params import PackedSeqParams

HEADS, HEAD_DIM = 8, 64  # the small model


def split_attention(q: Tensor, k: Tensor, v: Tensor, params: PackedSeqParams, rest: int) -> Tensor:
    """Causal self-attention of ``params`` (no padded twins) in two calls, equal to one call at ``params``:

    * the longest document, gathered on the device into ``params.max_seqlen_q`` rows of its own, one slot;
    * every slot at ``params``' offsets with max_seqlen ``rest``, which must bound every other document. The
      longest one is an over-long segment there: FA2 computes its first rows only, and they are discarded, with
      their gradients.

    No host sync: the longest document's place is found and gathered on the device.
    """
    cu = params.cu_seqlens_q.long()
    rows = torch.arange(q.shape[0], device=q.device)
    # One-element tensors throughout: indexing with a 0-d tensor would read it on the host.
    which = torch.argmax(cu[1:] - cu[:-1]).view(1)
    start, end = cu.index_select(0, which), cu.index_select(0, which + 1)
    in_long = (rows >= start) & (rows < end)
    width = params.max_seqlen_q
    # The gathered rows: the document, then copies of the stream's last row (dead: past the one slot's length).
    index = (start + torch.arange(width, device=q.device)).clamp_(max=q.shape[0] - 1)
    cu_long = torch.cat([torch.zeros_like(start), end - start]).to(torch.int32)
    alone = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_long, cu_seqlens_kv=cu_long, max_seqlen_q=width, max_seqlen_kv=width
    )
    out_long = varlen_attention(*(t.index_select(0, index) for t in (q, k, v)), alone)
    # Each row of the stream reads its own row of the gathered output (rows outside the document are discarded).
    out_long = out_long.index_select(0, (rows - start).clamp_(0, width - 1))
    others = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=params.cu_seqlens_q,
        cu_seqlens_kv=params.cu_seqlens_kv,
        max_seqlen_q=rest,
        max_seqlen_kv=rest,
    )
    # The engine's own dead-row rule: identity forward, exact zeros outside ``keep`` in the backward.
    keep = ~in_long
    out_rest = varlen_attention(*(_ZeroDeadRowGrad.apply(t, keep) for t in (q, k, v)), others)
    return torch.where(in_long[:, None, None], out_long, out_rest)


def _fwd_bwd(attend, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor):
    def once() -> tuple[Tensor, ...]:
        out = attend(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        # Detached, so no autograd graph outlives the call: a kept graph keeps q/k/v's AccumulateGrad nodes on the
        # stream that made them, and a later capture on another stream then fails (cudaErrorStreamCaptureImplicit).
        return (out.detach(), *grads)

    return once


@contextlib.contextmanager
def short_docs_from(slots: int | None):
    """``varlen_attention`` runs packgraph.ops.short_docs from ``slots`` slots on, inside the block."""
    before = slot_boundary.SHORT_DOCS_MIN_SLOTS
    slot_boundary.SHORT_DOCS_MIN_SLOTS = slots
    try:
        yield
    finally:
        slot_boundary.SHORT_DOCS_MIN_SLOTS = before


ONE_CALL, SHORT_DOCS = None, 1


def _median_ms(fn, device: torch.device, reps: int) -> float:
    if device.type == "cuda":
        return statistics.median(graph_replay_ms(fn, device, reps=reps))
    return float("nan")  # the reference on the CPU times nothing worth reporting


def _backward_peak_mib(fn, device: torch.device) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del result
    return peak / 2**20


def measure(T: int, *, min_capacity: int, reps: int, device: torch.device, seed: int = 0) -> list[dict]:
    policy = default_buckets(T)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(T, HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen) for _ in range(3))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    grad_out = torch.randn(T, HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    rows, seen = [], set()
    for batch in batch_stream("buckets", T, 201, policy=policy):
        lengths = sorted(batch.doc_lengths)
        n, longest = len(lengths), lengths[-1]
        bucket = policy.bucket_for(longest, n)
        if bucket.capacity < min_capacity or (bucket.max_seqlen, bucket.capacity) in seen:
            continue
        seen.add((bucket.max_seqlen, bucket.capacity))
        rest = next(r for r in policy.max_seqlen_ladder if r >= lengths[-2]) if n > 1 else 1
        docs = list(batch.doc_lengths)

        def params_at(max_seqlen: int, capacity: int, docs=docs) -> PackedSeqParams:
            return PackedSeqParams.from_seqlens(
                docs, capacity=capacity, total_tokens=T, max_seqlen=max_seqlen, device=device
            )

        exact, at_bucket = params_at(longest, n), params_at(bucket.max_seqlen, bucket.capacity)
        one = _fwd_bwd(lambda a, b, c, p=at_bucket: varlen_attention(a, b, c, p), q, k, v, grad_out)
        eager = _fwd_bwd(lambda a, b, c, p=exact: varlen_attention(a, b, c, p), q, k, v, grad_out)
        runs = {  # name: (slots from which short_docs runs, fn)
            "eager": (ONE_CALL, eager),
            "bucket": (ONE_CALL, one),
            "split": (
                ONE_CALL,
                _fwd_bwd(lambda a, b, c, p=at_bucket, r=rest: split_attention(a, b, c, p, r), q, k, v, grad_out),
            ),
            "short_docs": (SHORT_DOCS, one),
            "eager_short_docs": (SHORT_DOCS, eager),
        }
        diffs = {}
        with short_docs_from(ONE_CALL):
            want = one()
        for name in ("split", "short_docs"):
            with short_docs_from(runs[name][0]):
                got = runs[name][1]()
            diffs[name] = max((w.float() - g.float()).abs().max().item() for w, g in zip(want, got, strict=True))
            if diffs[name] != diffs[name]:
                raise RuntimeError(f"{name} attention gave NaN at bucket {bucket}: a row it should discard leaked")
        ms, peak = {}, {}
        for name, (slots, fn) in runs.items():
            with short_docs_from(slots):
                ms[name] = _median_ms(fn, device, reps)
                peak[name] = _backward_peak_mib(fn, device)
        rows.append(
            dict(
                T=T,
                docs=n,
                longest=longest,
                second=lengths[-2] if n > 1 else 0,
                bucket=[bucket.max_seqlen, bucket.capacity],
                rest=rest,
                **{f"{name}_ms": t for name, t in ms.items()},
                **{f"{name}_peak_mib": m for name, m in peak.items()},
                **{f"{name}_max_abs_diff_vs_bucket": d for name, d in diffs.items()},
            )
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--min-capacity", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = measure(args.T, min_capacity=args.min_capacity, reps=args.reps, device=device)
    lines = [
        "| docs | longest | bucket | eager ms | bucket ms | split ms | short_docs ms | eager short_docs ms | "
        "short_docs / bucket | short_docs / eager | peak MiB eager / bucket / short_docs | "
        "max diff split / short_docs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['docs']} | {r['longest']} | {r['bucket'][0]} x {r['bucket'][1]} | "
            f"{r['eager_ms']:.3f} | {r['bucket_ms']:.3f} | {r['split_ms']:.3f} | {r['short_docs_ms']:.3f} | "
            f"{r['eager_short_docs_ms']:.3f} | {r['short_docs_ms'] / r['bucket_ms']:.2f} | "
            f"{r['short_docs_ms'] / r['eager_ms']:.2f} | "
            f"{r['eager_peak_mib']:.0f} / {r['bucket_peak_mib']:.0f} / {r['short_docs_peak_mib']:.0f} | "
            f"{r['split_max_abs_diff_vs_bucket']:.3g} / {r['short_docs_max_abs_diff_vs_bucket']:.3g} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        write_table(args.out, "attention_split", table, rows, dict(argv=vars(args), machine=machine_info(device)))


if __name__ == "__main__":
    main()
