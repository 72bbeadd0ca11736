"""Document-mask attention: FlexAttention over one packed stream, its mask built on the device from the offsets.

:func:`doc_mask_attention` is self-attention over a ``[T, H, D]`` stream of packed documents with the contract of
:func:`~packgraph.ops.varlen_attention` (GQA, causal, ``window``, ``softcap``, padded layouts, ghost slots, dead rows
exact zeros), computed by ``torch.nn.attention.flex_attention`` with a block mask. Each row's document and liveness
come from ``cu_seqlens`` by ``searchsorted`` on the device, so nothing is read on the host. The launch depends on
``T`` and the mask's blocks only: not on ``max_seqlen`` nor on the number of documents. A graph of a layer that uses
it therefore serves every packing of its ``T``, with no bucket ladder.

It is ``varlen_attention``'s ``"doc_mask"`` backend, which runs it ``compiled`` on CUDA (FlexAttention fuses its kernel
only compiled): the block mask's build and the attention are compiled apart, the rows' documents computed eagerly
between them. On the H200 (torch 2.11), compiled, it matched the float64 reference within 3.5e-3 in bf16 (outputs and
grads, causal, windows, softcapping, padded layouts), and one CUDA graph of its forward and backward, block mask
included, replayed 8 packings of 1 to 13 documents with no host read and the values of the compiled call
(tests/cuda/test_doc_mask_cuda.py; bench/results/2026-12-03-h200-gpu-check-slot-fix/). Its kernel's speed hangs
on its tiles (:func:`default_tiles`): with their forward and backward tiles (timed before their TMA loads), at
T=8192 in bf16 on one packing per mix, the kernel's forward+backward took 0.81-0.89x FA2's (``varlen_attention``'s)
at head size 64 and 0.71-0.81x at 128, the block mask built ahead (bench/results/2026-12-04-h200-backends-8192/).
.. warning:: torch 2.13's FlexAttention has no backward on the CPU: there it serves forward passes only (scoring,
   and the CPU tests of this module).
.. warning:: A block that straddles two documents multiplies one document's values by the other's zero
   probabilities: a NaN or Inf in one document's keys or values reaches its neighbours, where FlashAttention's
   varlen kernel never reads them. Finite inputs give the same results. Rows of no document are zeroed first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from packgraph.params import PackedSeqParams

__all__ = ["compile_static", "default_tiles", "doc_mask_attention", "document_block_mask"]


def _rows(params: PackedSeqParams, total: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Per row of the stream: the slot that holds it, and whether it is a real token (int64 ``[T]``, bool ``[T]``)."""
    layout = params.layout_offsets("q").to(device=device, dtype=torch.long)
    lengths = (params.cu_seqlens_q[1:] - params.cu_seqlens_q[:-1]).to(device=device, dtype=torch.long)
    slots = lengths.numel()
    rows = torch.arange(total, device=device)
    # The slot whose layout span holds the row: the count of slot ends at or before it (ghost slots, empty, end
    # where they start and are skipped). Rows past the last end get ``slots`` (the dead tail). The ends are
    # counted in the whole offsets minus the start, not searched in ``layout[1:]``: torch 2.11's Inductor cannot
    # lower searchsorted over a slice (NotImplementedError: SliceView).
    slot = torch.searchsorted(layout, rows, right=True) - (layout[0] <= rows).long()
    clamped = slot.clamp(max=max(slots - 1, 0))
    live = (slot < slots) & (rows - layout[clamped] < lengths[clamped])
    return slot, live


def document_block_mask(
    packed_seq_params: PackedSeqParams,
    total: int,
    device: torch.device,
    *,
    causal: bool = True,
    window: tuple[int, int] | None = None,
    compiled: bool = False,
    block_size: int = 128,
) -> tuple[Any, Tensor]:
    """The FlexAttention block mask of a packed stream of ``total`` rows, and its live rows (bool ``[total]``).

    A query row sees the keys of its own document only (causal and ``window`` as in ``varlen_attention``); rows of no
    document see nothing. Built on ``device`` from the offsets, with no host read; ``compiled`` builds it with
    ``create_block_mask`` under torch.compile (eagerly it evaluates the mask at every (query, key) pair); inside a
    caller's torch.compile the caller's graph then breaks here, as at :func:`doc_mask_attention`. ``block_size``:
    the rows and keys of one block (FlexAttention's ``BLOCK_SIZE``); the kernel's tiles must divide it. Inductor
    checks its *default* backward tiles against the block before it applies a caller's ``bwd_`` tiles, so a block
    smaller than those defaults has no backward at all (torch 2.11, H200, 64: ``NoValidChoicesError``).
    """
    if compiled:
        return _compiled_mask(packed_seq_params, total, device, causal, window, block_size)
    from torch.nn.attention.flex_attention import create_block_mask

    return _block_mask(packed_seq_params, total, device, causal, window, create_block_mask, block_size)


@torch.compiler.disable(reason="packgraph's document mask compiles its pieces apart (doc_mask_attention)")
def _compiled_mask(
    params: PackedSeqParams,
    total: int,
    device: torch.device,
    causal: bool,
    window: tuple[int, int] | None,
    block_size: int = 128,
) -> tuple[Any, Tensor]:
    return _block_mask(params, total, device, causal, window, _compiled("create_block_mask"), block_size)


def _block_mask(
    params: PackedSeqParams,
    total: int,
    device: torch.device,
    causal: bool,
    window: tuple[int, int] | None,
    build: Callable[..., Any],
    block_size: int,
) -> tuple[Any, Tensor]:
    # The rows' slots are computed here, outside any compiled region, and enter the mask's closure as tensors:
    # Inductor cannot render a mask_mod that indexes one of its own intermediates ("convert FlexibleLayout to
    # FixedLayout first", torch 2.11, T = 4096 and up).
    slot, live = _rows(params, total, device)
    left, right = window if window is not None else (-1, -1)

    def mask_mod(b: Any, h: Any, qi: Tensor, ki: Tensor) -> Tensor:
        keep = live[qi] & live[ki] & (slot[qi] == slot[ki])
        if causal:
            keep = keep & (ki <= qi)
        if left >= 0:
            keep = keep & (qi - ki <= left)
        if right >= 0:
            keep = keep & (ki - qi <= right)
        return keep

    return build(mask_mod, 1, None, total, total, device=device, BLOCK_SIZE=block_size), live


# Measured on the H200 (sm90, bf16, torch 2.11, T=8192; bench/results/2026-12-03-h200-backends-tiles/ and
# 2026-12-04-h200-backends-8192/). Forward: Inductor's default at head size 64 (128 x 128, 4 warps) made it 2-17x
# slower than these; at 64 and 128, on every mix, these gave the shortest forward+backward of the fixed choices.
# Backward: at head size 64 these tiles took 6-8% off the forward+backward on every mix (about max-autotune's); at
# 128 they were 18-21% slower than Inductor's default, which stays there. TMA loads took 12% off the forward at
# head size 64 on one long document (nothing on short ones) and slowed every backward and the forward at 128: at 64
# the forward alone takes them (``fwd_USE_TMA``; Inductor strips ``fwd_`` options from the backward's).
_SM90_FORWARD_TILES = {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3}
_SM90_D64 = {
    "fwd_USE_TMA": True,
    "bwd_BLOCK_M1": 64,
    "bwd_BLOCK_N1": 64,
    "bwd_BLOCK_M2": 64,
    "bwd_BLOCK_N2": 64,
    "bwd_num_warps": 4,
    "bwd_num_stages": 3,
}


def default_tiles(q: Tensor) -> dict[str, int | bool] | None:
    """The kernel options :func:`doc_mask_attention` uses for ``q`` when given none: the tiles measured best on sm90
    GPUs (H100, H200) for bf16 or fp16, forward at head sizes 64 and 128, backward and the forward's TMA loads at 64;
    else ``None`` (Inductor's default)."""
    if (
        q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[-1] in (64, 128)
        and _capability(q.device.index) == (9, 0)
    ):
        return _SM90_FORWARD_TILES | (_SM90_D64 if q.shape[-1] == 64 else {})
    return None


@torch.compiler.assume_constant_result
def _capability(index: int | None) -> tuple[int, int]:
    # a constant to a caller's torch.compile, which traces default_tiles (doc_mask_attention inside a compiled model)
    return torch.cuda.get_device_capability(index)


def doc_mask_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    packed_seq_params: PackedSeqParams,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    compiled: bool = False,
    mask: tuple[Any, Tensor] | None = None,
    kernel_options: Mapping[str, int | bool] | None = None,
    autotune: bool = False,
) -> Tensor:
    """Self-attention of packed documents, ``[T, Hq, D]`` x ``[T, Hkv, D]`` -> ``[T, Hq, D]``, by FlexAttention.

    Same options and results as :func:`~packgraph.ops.varlen_attention` for self-attention (``q`` and ``k`` rows
    in one layout); ``window`` is ``(left, right)`` in FlashAttention's convention (-1: unbounded). ``compiled``
    runs the block mask's build and the attention under torch.compile, each compiled once per shape, dtype, option
    set and grad mode at its first call (:func:`compile_static`): FlexAttention fuses its kernel only compiled.
    ``mask``: the ``(block_mask, live)`` of :func:`document_block_mask` for these params, ``causal`` and ``window``,
    built ahead; by default it is built here. ``kernel_options``: FlexAttention's (``fwd_BLOCK_M``,
    ``bwd_num_warps``, ...), which fix the kernel's tiles; by default :func:`default_tiles`, and ``{}`` keeps
    Inductor's default for the GPU, dtype and head size. ``autotune`` (with no ``kernel_options``) compiles the
    attention with ``mode="max-autotune-no-cudagraphs"``: Inductor times its candidate tiles at the first call of
    each shape and keeps the fastest (a longer first call).

    Called ``compiled`` inside a caller's torch.compile (a block or a whole model compiled), the attention is traced
    into the caller's graph; with no ``mask`` given the graph breaks once, where the mask is built (compiled on its
    own): traced into the caller's graph, the rows' documents would be intermediates of the mask's build, which
    Inductor fails to lower (above). ``autotune`` keeps the attention compiled apart, under its own mode.

    Raises:
        ValueError: ``q`` and ``k`` of different row counts (cross-attention: use ``varlen_attention``), or not
            ``[T, H, D]`` with ``Hq % Hkv == 0``.
    """
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"doc_mask_attention takes self-attention q [T, Hq, D] and k, v [T, Hkv, D] with Hq % Hkv == 0, got "
            f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}; use varlen_attention for other shapes"
        )
    options = None if kernel_options is None else dict(kernel_options)
    if compiled and torch.compiler.is_compiling() and not autotune:
        # Inside a caller's torch.compile the attention is traced into the caller's graph, so that the zeroing and
        # layout copies around the kernel fuse with their neighbours; only the mask's build breaks the graph (its
        # rows' documents must not be intermediates of the graph that reads them: see document_block_mask).
        block_mask, live = mask or document_block_mask(
            packed_seq_params, q.shape[0], q.device, causal=causal, window=window, compiled=True
        )
        return _attend(q, k, v, live, block_mask, softmax_scale, softcap, _resolved(q, options, autotune))
    if compiled:
        return _compiled_attention(
            q, k, v, packed_seq_params, causal, softmax_scale, window, softcap, mask, options, autotune
        )
    block_mask, live = mask or document_block_mask(
        packed_seq_params, q.shape[0], q.device, causal=causal, window=window
    )
    return _attend(q, k, v, live, block_mask, softmax_scale, softcap, _resolved(q, options, autotune))


def _resolved(q: Tensor, options: dict[str, int | bool] | None, autotune: bool) -> dict[str, int | bool] | None:
    """The kernel options to run: the caller's, else none under ``autotune``, else :func:`default_tiles`."""
    return options if options is not None or autotune else default_tiles(q)


@torch.compiler.disable(reason="packgraph's document mask compiles its pieces apart (doc_mask_attention)")
def _compiled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    params: PackedSeqParams,
    causal: bool,
    scale: float | None,
    window: tuple[int, int] | None,
    softcap: float | None,
    mask: tuple[Any, Tensor] | None,
    kernel_options: dict[str, int | bool] | None,
    autotune: bool,
) -> Tensor:
    """:func:`doc_mask_attention` with ``compiled=True``, outside any caller's compiled graph."""
    if mask is None:
        mask = document_block_mask(params, q.shape[0], q.device, causal=causal, window=window, compiled=True)
    block_mask, live = mask
    attend = _compiled("attend-autotune" if autotune else "attend")
    return attend(q, k, v, live, block_mask, scale, softcap, _resolved(q, kernel_options, autotune))


def _attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    live: Tensor,
    block_mask: Any,
    scale: float | None,
    softcap: float | None,
    kernel_options: dict[str, int | bool] | None = None,
) -> Tensor:
    """FlexAttention over ``[T, H, D]`` rows under ``block_mask``, with rows of no document zeroed in and out."""
    from torch.nn.attention.flex_attention import flex_attention

    total = q.shape[0]
    # Rows of no document could hold anything (NaN from a diverged run): a partly masked block still multiplies
    # their values by a zero probability, so they are zeroed first, as FlashAttention never reads them. Their
    # queries too, so that their grads are exact zeros whatever the kernel does with a row that sees no key. The
    # zeroing runs on the [1, H, T, D] views FlexAttention takes, so that its results are 4-D buffers: Inductor's CPU
    # template takes no other (a 3-D buffer under a view failed to lower), and compiled, Inductor lays them out.
    keep = live.view(1, 1, total, 1)
    q, k, v = (
        torch.where(keep, x.transpose(0, 1).unsqueeze(0), torch.zeros((), dtype=x.dtype, device=x.device))
        for x in (q, k, v)
    )

    score_mod = None
    if softcap is not None:

        def score_mod(score: Tensor, b: Any, h: Any, qi: Tensor, ki: Tensor) -> Tensor:
            return softcap * torch.tanh(score / softcap)

    out = flex_attention(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
        kernel_options=kernel_options,
    )
    out = out[0].transpose(0, 1)
    # A row with no key (dead, or a ghost's) is defined as zeros, whatever the kernel leaves there.
    return torch.where(live.view(total, 1, 1), out, torch.zeros((), dtype=out.dtype, device=out.device))


@functools.cache
def _compiled(name: str) -> Callable[..., Any]:
    """One compiled callable per process for each piece (the caches of torch.compile are per callable)."""
    from torch.nn.attention.flex_attention import create_block_mask

    if name == "attend-autotune":
        return compile_static(_attend, mode="max-autotune-no-cudagraphs")
    return compile_static({"create_block_mask": create_block_mask, "attend": _attend}[name])


def compile_static(fn: Callable[..., Tensor], mode: str | None = None) -> Callable[..., Tensor]:
    """``fn`` under ``torch.compile(dynamic=False, mode=mode)``: each shape, dtype, option set and grad mode compiles
    once, at its first call.

    FlexAttention fuses its kernel only compiled; eagerly it materialises every score. Past dynamo's recompile
    limit (8 by default) a call would silently run that unfused eager path: the limit is raised to 64 within the
    calls, and a hit raises instead.
    """
    compiled = torch.compile(fn, dynamic=False, mode=mode)
    config = torch._dynamo.config
    names = getattr(config, "_config", {})
    limits: dict[str, Any] = {name: 64 for name in ("recompile_limit", "cache_size_limit") if name in names}
    limits |= {name: True for name in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit") if name in names}

    def call(*args: Any, **kwargs: Any) -> Tensor:
        with config.patch(limits):
            return compiled(*args, **kwargs)

    return call
