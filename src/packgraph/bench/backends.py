"""Attention backends side by side (``packgraph bench --backends``): what a graphed layer's attention costs on each.

For each packing of the benchmark's mixes, at each ``T`` and head size, the forward and the forward+backward of

* ``flash``: :func:`~packgraph.ops.varlen_attention` on the packing's bucket (``default_buckets(T)``), what a graphed
  layer runs;
* ``fa2-op``: torch's FlashAttention-2 varlen op alone, on the same bucketed offsets and ``max_seqlen``: the
  difference from ``flash`` is the wrapper's (offset checks, dead-row zeroing, chunked backward, short_docs);
* ``fa2-op-exact``: the same op on the exact offsets (capacity = documents, ``max_seqlen`` = the longest), the
  eager choice: the difference from ``fa2-op`` is the bucket's;
* ``doc_mask``: ``varlen_attention(..., backend="doc_mask")`` (FlexAttention, compiled) under
  ``document_mask_buckets(T)``: one launch for every packing of ``T`` rows;
* ``doc_mask-kernel``: the same compiled attention (dead rows zeroed, FlexAttention) on a block mask built once,
  outside the timing: the difference from ``doc_mask`` is what building the mask on the device costs in the graph.

Each is timed as the median of CUDA-graph replays (CUDA events), as packgraph runs it. ``first_s`` is the wall time
of the backend's first forward+backward call on that packing, before any timing: for the document mask at a new
``T`` and head size, torch.compile's cost. Throughput counts only the work inside documents under the causal mask:
``4 * D * Hq`` flops per visible (query, key) pair forward, 2.5 times that backward (FlashAttention's accounting),
so every backend is scored on the same useful work.

:func:`wrapper_kernels` lists, kernel by kernel, what ``flash`` launches beyond ``fa2-op`` on one packing.
:func:`flex_tiles` times the document mask's kernel under several FlexAttention tile choices and under Inductor's
autotuning, against ``flash``: Inductor's default tiles for bf16 at head size 64 on the H200 made the forward
slower than the forward+backward at head size 128.
:func:`declared_size_sweep` holds one packing fixed and grows what a graph declares instead: ``max_seqlen`` from
the longest document to ``T``, and the slot capacity from the document count to 512. FlashAttention's launch grid
grows with both; the document mask declares neither. :func:`short_docs_switch` times the short-documents path
against one FA2 call on buckets of 129 documents and more: the local path's cost grows with ``T``, FA2's with the
slots, so where one wins depends on both (docs/buckets.md).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from packgraph import slot_boundary
from packgraph.bench.attention import median_ms
from packgraph.bench.data import batch_stream
from packgraph.bench.report import markdown_table
from packgraph.buckets import default_buckets, document_mask_buckets
from packgraph.ops import varlen_attention
from packgraph.ops.attention import _torch_varlen_api
from packgraph.ops.doc_mask import doc_mask_attention, document_block_mask
from packgraph.params import PackedSeqParams

__all__ = [
    "BACKENDS",
    "FLEX_TILES",
    "backend_benchmark",
    "causal_flops",
    "declared_size_sweep",
    "flex_tiles",
    "short_docs_switch",
    "switch_doc_counts",
    "switch_markdown",
    "switch_packing",
    "tiles_markdown",
    "wrapper_kernels",
]

BACKENDS: tuple[str, ...] = ("flash", "fa2-op", "fa2-op-exact", "doc_mask", "doc_mask-kernel")
BACKWARD_FLOPS = 2.5  # backward flops per forward flop, FlashAttention's convention


def _leaves(
    T: int, heads: int, kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``q [T, heads, D]`` and ``k, v [T, kv_heads, D]`` leaves that require grad."""
    shapes = ((T, heads, head_dim), (T, kv_heads, head_dim), (T, kv_heads, head_dim))
    q, k, v = (torch.randn(s, device=device, dtype=dtype, generator=gen).requires_grad_() for s in shapes)
    return q, k, v


def error_line(exc: BaseException) -> str:
    """An exception as one line for a row: its type and first line."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def causal_flops(lengths: Sequence[int], heads: int, head_dim: int) -> float:
    """Forward flops of causal attention within each document: ``4 * D * Hq`` per visible (query, key) pair."""
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return 4.0 * head_dim * heads * pairs


def _runner(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], T: int
) -> Callable[[], torch.Tensor]:
    """``attend()`` of one backend on one packing (its params, and the kernel's block mask, built here)."""
    device = q.device
    raw = PackedSeqParams.from_seqlens(lengths, total_tokens=T, max_seqlen=T, device=device)
    if backend == "flash":
        params = default_buckets(T).apply(raw)
        return lambda: varlen_attention(q, k, v, params, causal=True)
    if backend == "doc_mask":
        params = document_mask_buckets(T).apply(raw)
        return lambda: varlen_attention(q, k, v, params, causal=True, backend="doc_mask")
    if backend == "doc_mask-kernel":
        return _flex_kernel(q, k, v, document_mask_buckets(T).apply(raw))
    if backend == "fa2-op":
        params = default_buckets(T).apply(raw)
    else:
        params = PackedSeqParams.from_seqlens(
            lengths, capacity=len(lengths), total_tokens=T, max_seqlen=max(lengths), device=device
        )
    return _bare_fa2(q, k, v, params)


def _bare_fa2(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: PackedSeqParams) -> Callable[[], torch.Tensor]:
    """torch's varlen op alone on ``params``' offsets and ``max_seqlen``: no checks, no dead rows, no chunks."""
    api = _torch_varlen_api()
    if api is None or q.device.type != "cuda":
        raise RuntimeError("torch's varlen_attn op runs on CUDA only (torch >= 2.10)")
    cu, max_q = params.cu_seqlens_q, params.max_seqlen_q
    return lambda: api(q, k, v, cu, cu, max_q, max_q, causal=True, softmax_scale=None)


def _flex_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: PackedSeqParams, **options: Any
) -> Callable[[], torch.Tensor]:
    """The document mask's attention on a block mask built now, once (compiled on CUDA, as the backend runs it);
    ``options``: the mask's ``block_size``, and ``kernel_options`` or ``autotune`` of
    :func:`~packgraph.ops.doc_mask.doc_mask_attention`."""
    block_size = options.pop("block_size", 128)
    mask = document_block_mask(params, q.shape[0], q.device, compiled=q.is_cuda, block_size=block_size)
    return lambda: doc_mask_attention(q, k, v, params, compiled=q.is_cuda, mask=mask, **options)


def _times(
    backend: str, qkv: tuple[torch.Tensor, ...], grad_out: torch.Tensor, lengths: list[int], T: int, reps: int
) -> dict[str, Any]:
    """``fwd_ms`` and ``fwdbwd_ms`` of one backend on one packing; the forward's stays if the backward fails."""
    return _times_of(_runner(backend, *qkv, lengths, T), qkv, grad_out, reps)


def _times_of(
    attend: Callable[[], torch.Tensor], qkv: tuple[torch.Tensor, ...], grad_out: torch.Tensor, reps: int
) -> dict[str, Any]:
    """``first_s``, ``fwd_ms`` and ``fwdbwd_ms`` of ``attend``; the forward's stays if the backward fails."""
    times: dict[str, Any] = {}
    try:
        times["first_s"] = _first_call_s(lambda: torch.autograd.grad(attend(), qkv, grad_out), qkv[0].device)
    except (RuntimeError, NotImplementedError):
        pass  # the CPU's FlexAttention has no backward: its forward is timed below, and the error recorded
    with torch.no_grad():
        times["fwd_ms"] = median_ms(attend, qkv[0].device, reps=reps)
    try:
        times["fwdbwd_ms"] = _fwdbwd_ms(attend, qkv, grad_out, reps)
    except (RuntimeError, NotImplementedError) as exc:
        times["error"] = error_line(exc)
    return times


def _fwdbwd_ms(
    attend: Callable[[], torch.Tensor], qkv: tuple[torch.Tensor, ...], grad_out: torch.Tensor, reps: int
) -> float:
    return median_ms(lambda: torch.autograd.grad(attend(), qkv, grad_out), qkv[0].device, reps=reps)


def _first_call_s(fn: Callable[[], object], device: torch.device) -> float:
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


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
                q, k, v = _leaves(T, heads, kv_heads, head_dim, device, dtype, gen)
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
                            row["error"] = error_line(exc)
                        for key, work in (("fwd", flops), ("fwdbwd", flops * (1 + BACKWARD_FLOPS))):
                            ms = row.get(f"{key}_ms")
                            row[f"{key}_tflops"] = work / (ms * 1e9) if ms else None
                        rows.append(row)
                        if on_row is not None:
                            on_row(row)
    return rows


def declared_size_sweep(
    T: int,
    head_dim: int,
    *,
    mix: str = "corpus",
    heads: int = 16,
    kv_heads: int = 8,
    reps: int = 10,
    seed: int = 0,
    device: torch.device | str = "cuda",
    max_corpus_docs: int | None = None,
    out_of_time: Callable[[], bool] = lambda: False,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Forward+backward ms of one packing of ``mix`` at ``T`` as the declared sizes grow, one axis at a time.

    ``flash`` (what a graphed layer runs: short_docs from its slot threshold on) and ``fa2-op`` (the bare op) at
    ``max_seqlen`` = the longest document, then each power of two above it up to ``T`` (capacity = the document
    count); then at capacity = the document count, then each power of two above it up to 512 (``max_seqlen`` = the
    longest). ``doc_mask`` once, under ``axis="none"``: it declares neither.
    """
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(seed)
    (batch,) = batch_stream(mix, T, 1, seed=seed + 7, max_corpus_docs=max_corpus_docs)
    lengths = list(batch.doc_lengths)
    docs, longest = len(lengths), max(lengths)
    q, k, v = qkv = _leaves(T, heads, kv_heads, head_dim, device, dtype, gen)
    grad_out = torch.ones_like(q)
    sizes = [("max_seqlen", m, docs) for m in _doublings(longest, T)]
    sizes += [("capacity", longest, c) for c in _doublings(docs, max(512, docs))]
    cases = [(axis, backend, m, c) for axis, m, c in sizes for backend in ("flash", "fa2-op")]
    cases.append(("none", "doc_mask", None, None))
    rows: list[dict[str, Any]] = []
    for axis, backend, declared_max, capacity in cases:
        if out_of_time():
            break
        row: dict[str, Any] = dict(
            T=T, mix=mix, head_dim=head_dim, docs=docs, longest=longest, axis=axis, backend=backend,
            declared_max=declared_max, capacity=capacity,
        )  # fmt: skip
        try:
            if backend == "doc_mask":
                attend = _runner("doc_mask", q, k, v, lengths, T)
            else:
                params = PackedSeqParams.from_seqlens(
                    lengths, capacity=capacity, total_tokens=T, max_seqlen=declared_max, device=device
                )
                attend = (
                    (lambda p=params: varlen_attention(q, k, v, p, causal=True))
                    if backend == "flash"
                    else _bare_fa2(q, k, v, params)
                )
            row["fwdbwd_ms"] = _fwdbwd_ms(attend, qkv, grad_out, reps)
        except (RuntimeError, NotImplementedError) as exc:
            row["error"] = error_line(exc)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def _tiles(m: int, n: int, warps: int, stages: int, *, backward: bool = False) -> dict[str, int]:
    """FlexAttention kernel options: the forward's tiles (``m`` queries x ``n`` keys), or with ``backward`` the
    backward's, in Inductor's own pairing (``BLOCK_M1 = BLOCK_N2 = m``, ``BLOCK_N1 = BLOCK_M2 = n``)."""
    if backward:
        blocks = {"BLOCK_M1": m, "BLOCK_N1": n, "BLOCK_M2": n, "BLOCK_N2": m}
        return {f"bwd_{k}": v for k, v in blocks.items()} | {"bwd_num_warps": warps, "bwd_num_stages": stages}
    return {"fwd_BLOCK_M": m, "fwd_BLOCK_N": n, "fwd_num_warps": warps, "fwd_num_stages": stages}


_FWD = _tiles(64, 64, 4, 3)  # default_tiles' choice on sm90, stated here so that the study runs it on any GPU
FLEX_TILES: dict[str, dict[str, Any]] = {
    "packgraph default": {},
    "Inductor default": {"kernel_options": {}},
    "fwd 64x64 w4 s3": {"kernel_options": _FWD},
    "fwd 64x64 w4 s3 TMA, bwd 64x64 w4 s3": {
        "kernel_options": {**_FWD, "fwd_USE_TMA": True, **_tiles(64, 64, 4, 3, backward=True)}
    },
    "fwd 64x64 w4 s3, bwd 64x64 w4 s3": {"kernel_options": {**_FWD, **_tiles(64, 64, 4, 3, backward=True)}},
    "fwd 64x64 w4 s3, bwd 32x64 w4 s3": {"kernel_options": {**_FWD, **_tiles(32, 64, 4, 3, backward=True)}},
    "fwd 64x64 w4 s3, bwd 64x64 w4 s4": {"kernel_options": {**_FWD, **_tiles(64, 64, 4, 4, backward=True)}},
    "autotune": {"autotune": True},
}
"""The document mask's kernel choices :func:`flex_tiles` times: packgraph's default (:func:`~packgraph.ops.doc_mask.
default_tiles`); Inductor's default for the GPU, dtype and head size; the forward tiles packgraph picks on sm90
(``BLOCK_M`` queries x ``BLOCK_N`` keys, warps, pipeline stages), alone and with three backward tilings from
Inductor's autotuning candidates (its sm90 default for head sizes 64-128 is 64 x 128 with 8 warps); the same with
the forward's loads by the Hopper tensor memory accelerator (``fwd_USE_TMA``: the forward only, since TMA in both
made the backward slower in every cell of bench/results/2026-12-04-h200-backends-8192/, while it took 12% off the
forward at head size 64 on one long document); and ``mode="max-autotune-no-cudagraphs"``, which times Inductor's
candidates at the first call. The forward tilings of an earlier study (128 x 64, 128 x 128, TMA alone) are in
bench/results/2026-12-03-h200-backends-tiles/."""


def flex_tiles(
    T: int,
    head_dims: Sequence[int],
    *,
    mixes: Sequence[str] = ("corpus", "long", "short"),
    heads: int = 16,
    kv_heads: int = 8,
    reps: int = 10,
    seed: int = 0,
    device: torch.device | str = "cuda",
    tiles: dict[str, dict[str, Any]] = FLEX_TILES,
    out_of_time: Callable[[], bool] = lambda: False,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One packing per mix at ``T``: ``fwd_ms``, ``fwdbwd_ms`` and ``first_s`` of ``doc_mask-kernel`` under each
    choice of ``tiles``, and of ``flash`` (``tiles="-"``) on the same packing, per head size. ``first_s`` of a new
    choice includes its compilation (the autotuning's too), at the first mix of each head size."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(seed)
    rows: list[dict[str, Any]] = []
    for head_dim in head_dims:
        q, k, v = qkv = _leaves(T, heads, kv_heads, head_dim, device, dtype, gen)
        grad_out = torch.ones_like(q)
        for mix in mixes:
            (batch,) = batch_stream(mix, T, 1, seed=seed + 7)
            lengths = list(batch.doc_lengths)
            raw = PackedSeqParams.from_seqlens(lengths, total_tokens=T, max_seqlen=T, device=device)
            cases = [("-", "flash", None)] + [(name, "doc_mask-kernel", options) for name, options in tiles.items()]
            for name, backend, options in cases:
                if out_of_time():
                    return rows
                row: dict[str, Any] = dict(
                    T=T, mix=mix, head_dim=head_dim, docs=len(lengths), longest=max(lengths), backend=backend,
                    tiles=name,
                )  # fmt: skip
                try:
                    if options is None:
                        attend = _runner("flash", q, k, v, lengths, T)
                    else:
                        attend = _flex_kernel(q, k, v, document_mask_buckets(T).apply(raw), **options)
                    row.update(_times_of(attend, qkv, grad_out, reps))
                except Exception as exc:  # a tile choice the GPU cannot run (Triton's OutOfResources) is a row's end
                    row["error"] = error_line(exc)
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    return rows


def tiles_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The tile study as a Markdown table."""
    header = ("T", "mix", "D", "docs", "longest", "backend", "tiles", "fwd ms", "fwd+bwd ms", "first s")
    cells = [
        [r["T"], r["mix"], r["head_dim"], r["docs"], r["longest"], r["backend"], r["tiles"], _fmt(r.get("fwd_ms")),
         r.get("error") or _fmt(r.get("fwdbwd_ms")), _fmt(r.get("first_s"))]
        for r in rows
    ]  # fmt: skip
    return markdown_table(header, cells) + "\n"


def wrapper_kernels(
    T: int,
    head_dim: int,
    *,
    mix: str = "corpus",
    heads: int = 16,
    kv_heads: int = 8,
    steps: int = 20,
    seed: int = 0,
    device: torch.device | str = "cuda",
) -> list[dict[str, Any]]:
    """What ``varlen_attention`` launches beyond the bare op: the kernels of one packing's forward+backward graph,
    ``flash`` against ``fa2-op`` on the same bucket, under ``torch.profiler`` over ``steps`` replays (CUDA only).

    One row per kernel name: ``flash_ms`` and ``op_ms`` per step (0.0 where a backend does not launch it), sorted by
    the difference, heaviest first, so the head of the list names the wrapper's cost.
    """
    from packgraph.backend_choice import capture_graph
    from packgraph.bench.profiling import gpu_busy_ms

    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    (batch,) = batch_stream(mix, T, 1, seed=seed + 7)
    lengths = list(batch.doc_lengths)
    q, k, v = qkv = _leaves(T, heads, kv_heads, head_dim, device, torch.bfloat16, gen)
    grad_out = torch.ones_like(q)
    per_backend: dict[str, dict[str, float]] = {}
    for backend in ("flash", "fa2-op"):
        attend = _runner(backend, q, k, v, lengths, T)
        graph = capture_graph(lambda attend=attend: torch.autograd.grad(attend(), qkv, grad_out), device)
        profile = gpu_busy_ms(lambda _, graph=graph: graph.replay(), steps=steps, top=1000)
        per_backend[backend] = {name: ms for name, ms in profile.top}
    names = set(per_backend["flash"]) | set(per_backend["fa2-op"])
    rows = [
        dict(T=T, mix=mix, head_dim=head_dim, docs=len(lengths), kernel=name,
             flash_ms=per_backend["flash"].get(name, 0.0), op_ms=per_backend["fa2-op"].get(name, 0.0))
        for name in names
    ]  # fmt: skip
    return sorted(rows, key=lambda r: r["op_ms"] - r["flash_ms"])


def kernels_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The wrapper's kernels as a Markdown table: ms per forward+backward step through packgraph and bare."""
    header = ("T", "mix", "D", "docs", "kernel", "flash ms", "fa2-op ms", "difference")
    cells = [
        [r["T"], r["mix"], r["head_dim"], r["docs"], r["kernel"].replace("|", "/"), f"{r['flash_ms']:.4f}",
         f"{r['op_ms']:.4f}", f"{r['flash_ms'] - r['op_ms']:+.4f}"]
        for r in rows
    ]  # fmt: skip
    return markdown_table(header, cells) + "\n"


def _doublings(start: int, stop: int) -> list[int]:
    """``start``, then each power of two above it up to ``stop``, then ``stop``."""
    values, p = [start], 1 << start.bit_length()
    while p < stop:
        values.append(p)
        p <<= 1
    return values + ([stop] if stop > start else [])


def switch_packing(T: int, docs: int, shape: str, seed: int = 0) -> list[int]:
    """``docs`` document lengths that fit in ``T`` rows: ``"even"``, each drawn from 1 to twice the mean share (the
    last ones cut to fit); ``"one-long"``, the same for all but one of ``T // 4`` rows, placed first."""
    gen = torch.Generator().manual_seed(seed)
    long = T // 4 if shape == "one-long" else 0
    share = max(1, (T - long) // docs)
    short = torch.randint(1, 2 * share, (docs - bool(long),), generator=gen).tolist() if share > 1 else []
    short = short or [1] * (docs - bool(long))
    lengths, room = ([long] if long else []), T - long
    for n in short:
        n = max(1, min(n, room - (docs - len(lengths) - 1)))  # leave a row for each document still to place
        lengths.append(n)
        room -= n
    return lengths


def switch_doc_counts(T: int) -> list[int]:
    """The document counts :func:`short_docs_switch` times at ``T``: the default switch (129 slots), then each power
    of two up to ``T // 4``; none where ``T // 4`` is below the switch."""
    return [n for n in _doublings(slot_boundary.DEFAULT, max(slot_boundary.DEFAULT, T // 4)) if n <= T // 4]


def short_docs_switch(
    T: int,
    head_dims: Sequence[int],
    *,
    doc_counts: Sequence[int] | None = None,
    shapes: Sequence[str] = ("even", "one-long"),
    heads: int = 16,
    kv_heads: int = 8,
    reps: int = 10,
    seed: int = 0,
    device: torch.device | str = "cuda",
    out_of_time: Callable[[], bool] = lambda: False,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Where :mod:`packgraph.ops.short_docs` beats one FA2 call: forward+backward of ``varlen_attention`` on the
    bucket of a packing of ``docs`` documents (:func:`switch_packing`), with the short-documents switch at its
    default (``short_ms``) and off (``fa2_ms``: one FA2 call, its backward in chunks past 512 slots), per head size.
    ``doc_counts`` defaults to :func:`switch_doc_counts`. One row per (T, head size, shape, docs): the bucket's
    ``capacity`` and ``max_seqlen``, both times and ``short_over_fa2``."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(seed)
    counts = list(doc_counts) if doc_counts is not None else switch_doc_counts(T)
    policy = default_buckets(T)
    cases = []  # (shape, lengths, params with the switch on): built once, timed at every head size
    for shape in shapes:
        for docs in counts:
            lengths = switch_packing(T, docs, shape, seed)
            raw = PackedSeqParams.from_seqlens(lengths, total_tokens=T, max_seqlen=T, device=device)
            cases.append((shape, lengths, policy.apply(raw)))
    rows: list[dict[str, Any]] = []
    for head_dim in head_dims:
        q, k, v = qkv = _leaves(T, heads, kv_heads, head_dim, device, dtype, gen)
        grad_out = torch.ones_like(q)
        for shape, lengths, on in cases:
            if out_of_time():
                return rows
            row: dict[str, Any] = dict(
                T=T, head_dim=head_dim, shape=shape, docs=len(lengths), longest=max(lengths),
                capacity=on.cu_seqlens_q.numel() - 1, max_seqlen=on.max_seqlen_q,
                short_docs_min_slots=on.short_docs_min_slots,
            )  # fmt: skip
            try:
                for key, params in (("short_ms", on), ("fa2_ms", dataclasses.replace(on, short_docs_min_slots=None))):
                    attend = functools.partial(varlen_attention, q, k, v, params, causal=True)
                    row[key] = _fwdbwd_ms(attend, qkv, grad_out, reps)
                row["short_over_fa2"] = row["short_ms"] / row["fa2_ms"]
            except (RuntimeError, NotImplementedError) as exc:
                row["error"] = error_line(exc)
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


def switch_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The short-documents switch study as a Markdown table."""
    header = ("T", "D", "shape", "docs", "longest", "capacity", "max_seqlen", "short_docs ms", "FA2 ms", "ratio")
    cells = [
        [r["T"], r["head_dim"], r["shape"], r["docs"], r["longest"], r["capacity"], r["max_seqlen"],
         r.get("error") or _fmt(r.get("short_ms")), _fmt(r.get("fa2_ms")), _fmt(r.get("short_over_fa2"))]
        for r in rows
    ]  # fmt: skip
    return markdown_table(header, cells) + "\n"


def sweep_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The declared-size sweep as a Markdown table: forward+backward ms at each declared size."""
    header = ("T", "mix", "D", "docs", "longest", "axis", "backend", "max_seqlen", "capacity", "fwd+bwd ms")
    cells = [
        [r["T"], r["mix"], r["head_dim"], r["docs"], r["longest"], r["axis"], r["backend"], r["declared_max"] or "-",
         r["capacity"] or "-", r.get("error") or _fmt(r.get("fwdbwd_ms"))]
        for r in rows
    ]  # fmt: skip
    return markdown_table(header, cells) + "\n"


def backends_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table: ms and TFLOP/s, forward and forward+backward, and the first call's seconds."""
    header = ("T", "mix", "D", "packing", "docs", "longest", "backend", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms",
              "fwd+bwd TFLOP/s", "first s")  # fmt: skip
    lines = []
    for r in rows:
        if "error" in r and r.get("fwd_ms") is None:
            cells = ["-", "-", "-", r["error"], "-"]
        else:
            cells = [
                _fmt(r.get("fwd_ms")),
                _fmt(r.get("fwd_tflops")),
                _fmt(r.get("fwdbwd_ms")),
                _fmt(r.get("fwdbwd_tflops")),
                _fmt(r.get("first_s")),
            ]
            if "error" in r:
                cells[-2] = r["error"]
        lines.append([r["T"], r["mix"], r["head_dim"], r["packing"], r["docs"], r["longest"], r["backend"], *cells])
    return markdown_table(header, lines) + "\n"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"
