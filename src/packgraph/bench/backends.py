"""Attention backends side by side (``packgraph bench --backends``): what a graphed layer's attention costs on each.

For each packing of the benchmark's mixes, at each ``T`` and head size, the forward and the forward+backward of

* ``flash``: :func:`~packgraph.ops.varlen_attention` on the packing's bucket (``default_buckets(T)``), what a graphed
  layer runs;
* ``fa2-op``: torch's FlashAttention-2 varlen op alone, on the same bucketed offsets and ``max_seqlen``: the
  difference from ``flash`` is the wrapper's (offset checks, dead-row zeroing, chunked backward, short_docs);
* ``fa2-op-exact``: the same op on the exact offsets (capacity = documents, ``max_seqlen`` = the longest), the
  eager choice: the difference from ``fa2-op`` is the bucket's;
* ``doc_mask``: ``varlen_attention(..., backend="doc_mask")`` (FlexAttention, compiled) under
  ``document_mask_buckets(T)``: one launch for every packing of ``T`` rows.

Each is timed as the median of CUDA-graph replays (CUDA events), as packgraph runs it. Throughput counts only the
work inside documents under the causal mask: ``4 * D * Hq`` flops per visible (query, key) pair forward, 2.5 times
that backward (FlashAttention's accounting), so every backend is scored on the same useful work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from packgraph.bench.attention import median_ms
from packgraph.bench.data import batch_stream
from packgraph.buckets import default_buckets, document_mask_buckets
from packgraph.ops import varlen_attention
from packgraph.ops.attention import _torch_varlen_api
from packgraph.params import PackedSeqParams

__all__ = ["BACKENDS", "backend_benchmark", "causal_flops"]

BACKENDS: tuple[str, ...] = ("flash", "fa2-op", "fa2-op-exact", "doc_mask")
BACKWARD_FLOPS = 2.5  # backward flops per forward flop, FlashAttention's convention


def causal_flops(lengths: Sequence[int], heads: int, head_dim: int) -> float:
    """Forward flops of causal attention within each document: ``4 * D * Hq`` per visible (query, key) pair."""
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return 4.0 * head_dim * heads * pairs


def _runner(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], T: int) -> Callable:
    """``attend()`` of one backend on one packing (its params built here, outside any timing)."""
    device = q.device
    raw = PackedSeqParams.from_seqlens(lengths, total_tokens=T, max_seqlen=T, device=device)
    if backend == "flash":
        params = default_buckets(T).apply(raw)
        return lambda: varlen_attention(q, k, v, params, causal=True)
    if backend == "doc_mask":
        params = document_mask_buckets(T).apply(raw)
        return lambda: varlen_attention(q, k, v, params, causal=True, backend="doc_mask")
    api = _torch_varlen_api()
    if api is None or device.type != "cuda":
        raise RuntimeError(f"{backend}: torch's varlen_attn op runs on CUDA only (torch >= 2.10)")
    if backend == "fa2-op":
        params = default_buckets(T).apply(raw)
    else:
        params = PackedSeqParams.from_seqlens(
            lengths, capacity=len(lengths), total_tokens=T, max_seqlen=max(lengths), device=device
        )
    cu, max_q = params.cu_seqlens_q, params.max_seqlen_q
    return lambda: api(q, k, v, cu, cu, max_q, max_q, causal=True, softmax_scale=None)


def _times(
    backend: str, qkv: tuple[torch.Tensor, ...], grad_out: torch.Tensor, lengths: list[int], T: int, reps: int
) -> dict[str, Any]:
    """``fwd_ms`` and ``fwdbwd_ms`` of one backend on one packing; the forward's stays if the backward fails."""
    attend = _runner(backend, *qkv, lengths, T)
    times: dict[str, Any] = {}
    with torch.no_grad():
        times["fwd_ms"] = median_ms(attend, qkv[0].device, reps=reps)
    try:
        times["fwdbwd_ms"] = median_ms(lambda: torch.autograd.grad(attend(), qkv, grad_out), qkv[0].device, reps=reps)
    except (RuntimeError, NotImplementedError) as exc:
        times["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return times


def backend_benchmark(
    T_values: Sequence[int],
    mixes: Sequence[str],
    head_dims: Sequence[int],
    *,
    heads: int = 16,
    kv_heads: int = 8,
    packings: int = 2,
    reps: int = 10,
    backends: Sequence[str] = BACKENDS,
    seed: int = 0,
    device: torch.device | str = "cuda",
    max_corpus_docs: int | None = None,
    out_of_time: Callable[[], bool] = lambda: False,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per (T, mix, head_dim, packing, backend): ``fwd_ms``, ``fwdbwd_ms`` and their ``*_tflops``, or an
    ``error`` (a backend this torch or device cannot run, e.g. the bare op on the CPU, or a CPU backward).

    bf16 on CUDA, float32 on the CPU (forward+backward of the document mask is then refused, as torch's
    FlexAttention has no CPU backward). Rows not started once ``out_of_time()`` holds are left out.
    """
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(seed)
    rows: list[dict[str, Any]] = []
    for T in T_values:
        for mix in mixes:
            stream = list(batch_stream(mix, T, packings, seed=seed + 7, max_corpus_docs=max_corpus_docs))
            for head_dim in head_dims:
                q = torch.randn(T, heads, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()
                k, v = (
                    torch.randn(T, kv_heads, head_dim, device=device, dtype=dtype, generator=gen).requires_grad_()
                    for _ in range(2)
                )
                grad_out = torch.ones_like(q)
                for index, batch in enumerate(stream):
                    lengths = list(batch.doc_lengths)
                    flops = causal_flops(lengths, heads, head_dim)
                    for backend in backends:
                        if out_of_time():
                            return rows
                        row: dict[str, Any] = dict(
                            T=T, mix=mix, head_dim=head_dim, heads=heads, kv_heads=kv_heads, packing=index,
                            backend=backend, docs=len(lengths), longest=max(lengths), causal_gflop=flops / 1e9,
                        )  # fmt: skip
                        try:
                            row.update(_times(backend, (q, k, v), grad_out, lengths, T, reps))
                        except (RuntimeError, NotImplementedError) as exc:
                            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                        for key, work in (("fwd", flops), ("fwdbwd", flops * (1 + BACKWARD_FLOPS))):
                            ms = row.get(f"{key}_ms")
                            row[f"{key}_tflops"] = work / (ms * 1e9) if ms else None
                        rows.append(row)
                        if on_row is not None:
                            on_row(row)
    return rows


def backends_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table: ms and TFLOP/s, forward and forward+backward."""
    lines = [
        "| T | mix | D | packing | docs | longest | backend | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r and r.get("fwd_ms") is None:
            cells = ["-", "-", "-", r["error"]]
        else:
            cells = [
                _fmt(r.get("fwd_ms")),
                _fmt(r.get("fwd_tflops")),
                _fmt(r.get("fwdbwd_ms")),
                _fmt(r.get("fwdbwd_tflops")),
            ]
            if "error" in r:
                cells[-1] = r["error"]
        head = [r["T"], r["mix"], r["head_dim"], r["packing"], r["docs"], r["longest"], r["backend"]]
        lines.append("| " + " | ".join(str(c) for c in [*head, *cells]) + " |")
    return "\n".join(lines) + "\n"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"
