"""Varlen attention over a packed (THD) token stream: torch's FlashAttention-2 varlen op on CUDA, an exact
reference everywhere else.

Contract (both paths):

* q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]`` with ``Hq % Hkv == 0`` (GQA: query head ``h`` reads kv head
  ``h // (Hq // Hkv)``). Self-attention has ``Tq == Tk``; q and kv may also have different offsets
  (cross-attention shapes). The output is ``[Tq, Hq, D]`` in q's dtype.
* Layout (docs/API.md): sequence ``i`` occupies rows ``[layout[i], layout[i] + len_i)`` where ``layout`` is
  ``cu_seqlens_*_padded`` when present, else ``cu_seqlens_*``, and ``len_i = cu[i + 1] - cu[i]``.
* Rows in no sequence ("dead" rows: padding, and the tail past the last offset) come out as exact zeros and
  receive exact-zero gradients.
* Causal masking with ``len_q != len_kv`` follows FlashAttention-2's **bottom-right** alignment: query ``i`` of
  a sequence sees key ``j`` iff ``j <= i + len_kv - len_q``. A query that sees no key outputs 0.
* Graph-safe: no ``.item()``/``.tolist()``/``.cpu()`` and no Python branch on device values. Everything
  derived from the offsets is built on the device with fixed shapes (capacity, T), so a captured graph stays
  valid when the offsets change. ``max_seqlen_*`` are static Python ints.

Options (keyword arguments; all static Python values except ``sinks``; each one is exact on every path that takes
it, and leaves the contract above as it is: dead rows are exact zeros with exact-zero grads, and NaN/Inf in one
document reaches no other):

* ``window=(left, right)``: FlashAttention's sliding window, bottom-right aligned like the causal mask: query
  ``i`` of a sequence sees key ``j`` iff ``i + shift - left <= j <= i + shift + right`` with
  ``shift = len_kv - len_q``; ``-1`` leaves that side unbounded. ``causal=True`` makes ``right`` 0. A window that
  bounds nothing (``(-1, -1)``; ``(-1, 0)``, which is ``causal``) is the same call as none.
* ``softcap=c``: Gemma-2's logit softcapping, ``scores = c * tanh(scores / c)`` after the scale and before the mask.
* ``sinks``: gpt-oss's attention sinks, one logit per query head (``[Hq]``) that joins each row's softmax
  denominator without a value: ``p_j = exp(s_j) / (sum_k exp(s_k) + exp(sinks[h]))``. Not scaled, not softcapped.
  A row that sees no key still outputs 0 and gives the sinks no grad; ``sinks``' grad sums over every live row, so
  a NaN in any document reaches it, as it would a weight's.

Which path takes what (:func:`varlen_attention` dispatches): the reference takes everything. FlashAttention-2
takes ``window`` (torch >= 2.11: ``varlen_attn``'s ``window_size``) in its one call, its slot-chunked backward and
short_docs. ``softcap`` and ``sinks`` run the reference on CUDA too, for now: exact, but O(Hq * Tq * Tk) memory
(docs/attention.md has the FlashAttention design for sinks).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from packgraph import slot_boundary
from packgraph.ops.doc_mask import doc_mask_attention
from packgraph.ops.flash_chunks import SLOTS_PER_BACKWARD, flash_attention_slot_chunks, gqa_max_seqlen_q
from packgraph.ops.short_docs import short_and_long_attention
from packgraph.params import PackedSeqParams, PackedSeqParamsError, slot_of_rows

__all__ = ["BACKENDS", "varlen_attention", "varlen_attention_reference", "row_layout", "RowLayout", "flash_offsets"]

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256
_MIN_TORCH_FOR_FLASH = "2.10"


class RowLayout(NamedTuple):
    """Where each row of a packed stream sits, computed on the device (all ``[n_rows]``, fixed shape).

    Attributes:
        slot: int64, the slot whose layout range ``[layout[s], layout[s + 1])`` holds the row; ``capacity``
            for rows past the last offset (the tail).
        pos: int64, ``row - layout[slot]``: the position within the sequence (it keeps counting through
            padding and the tail, whose rows are dead).
        length: int64, the real length of the row's sequence (0 for the tail).
        live: bool, the row holds a real token (``pos < length``).
    """

    slot: Tensor
    pos: Tensor
    length: Tensor
    live: Tensor


def row_layout(packed_seq_params: PackedSeqParams, which: str, n_rows: int) -> RowLayout:
    """:class:`RowLayout` of the ``"q"`` or ``"kv"`` side for a stream of ``n_rows`` rows. No host sync."""
    layout = packed_seq_params.layout_offsets(which).long()
    cu = getattr(packed_seq_params, f"cu_seqlens_{which}").long()
    rows = torch.arange(n_rows, device=layout.device)
    slot = slot_of_rows(layout, rows)
    pos = rows - layout.gather(0, slot)
    lengths = torch.cat([cu[1:] - cu[:-1], cu.new_zeros(1)])  # slot == capacity (tail) reads 0
    length = lengths.gather(0, slot)
    return RowLayout(slot, pos, length, pos < length)


def _kv_shares_q_offsets(params: PackedSeqParams) -> bool:
    """Whether kv's offsets are q's own tensors (and so are their padded twins): self-attention's one layout.
    Identity, not values: a check of values would read the device."""
    return params.cu_seqlens_kv is params.cu_seqlens_q and params.cu_seqlens_kv_padded is params.cu_seqlens_q_padded


def _one_layout(q: Tensor, k: Tensor, params: PackedSeqParams) -> bool:
    """Whether q's and k's rows are one layout: kv's offsets are q's own tensors, over as many rows."""
    return _kv_shares_q_offsets(params) and k.shape[0] == q.shape[0]


def _row_layouts(q: Tensor, k: Tensor, params: PackedSeqParams) -> tuple[RowLayout, RowLayout]:
    rows_q = row_layout(params, "q", q.shape[0])
    return rows_q, (rows_q if _one_layout(q, k, params) else row_layout(params, "kv", k.shape[0]))


def _live_rows(params: PackedSeqParams, which: str, n_rows: int) -> Tensor:
    """Bool ``[n_rows]``: the rows inside a document of the ``"q"`` or ``"kv"`` side. No host sync.

    Without a padded twin the documents fill ``[0, cu_seqlens[-1])`` back to back (offsets start at 0 and never
    decrease), so one comparison tells them; FlashAttention's path runs it in every layer, where the full
    :func:`row_layout` (a dozen small kernels) showed in its time. With a padded twin, the row layout's.
    """
    if getattr(params, f"cu_seqlens_{which}_padded") is not None:
        return row_layout(params, which, n_rows).live
    cu = getattr(params, f"cu_seqlens_{which}")
    return torch.arange(n_rows, device=cu.device) < cu[-1]


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, params: PackedSeqParams) -> None:
    """Shape/dtype/device checks that need no device values (cheap enough to run on every call)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"varlen_attention: {name} must be a [tokens, heads, head_dim] tensor, got {shape}")
    if k.shape != v.shape:
        raise ValueError(f"varlen_attention: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"varlen_attention: head_dim differs: q has {q.shape[2]}, k/v have {k.shape[2]}")
    if q.shape[2] < 1:
        raise ValueError(f"varlen_attention: head_dim (q.shape[2]) must be >= 1, got {q.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"varlen_attention: q heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]}) (GQA)"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"varlen_attention: q/k/v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.is_floating_point():
        raise ValueError(f"varlen_attention: q/k/v must be floating point, got {q.dtype}; cast them (.float()) first")
    if not (q.device == k.device == v.device):
        raise ValueError(f"varlen_attention: q/k/v devices differ: {q.device}, {k.device}, {v.device}")
    if params.qkv_format != "thd":
        raise PackedSeqParamsError("qkv_format", "varlen_attention needs 'thd'", f"got {params.qkv_format!r}")
    if params.local_cp_size is not None and params.local_cp_size > 1:
        # These rows are one rank's shard: attending among them alone would be silently wrong.
        raise PackedSeqParamsError(
            "local_cp_size",
            "context-parallel params need the context-parallel attention",
            f"local_cp_size={params.local_cp_size}; use packgraph.distributed.cp_varlen_attention, which gathers "
            "K/V across cp_group",
        )
    # Offsets past the stream would read out of bounds in the kernel; when the host knows them, check free. Not
    # while torch.compile traces: there the tensors' version counters (which say whether the host copies are
    # current) are unknowns Dynamo breaks the graph on, in every layer, and the copies' values would become guards.
    host = {} if torch.compiler.is_compiling() else (params.current_host_offsets() or {})
    for which, rows in (("q", q.shape[0]), ("kv", k.shape[0])):
        name = f"cu_seqlens_{which}"
        cu = getattr(params, name)
        if cu is None:
            raise PackedSeqParamsError(name, "required for qkv_format='thd'")
        if cu.dtype != torch.int32 or cu.dim() != 1:
            raise PackedSeqParamsError(name, "must be a 1-D int32 tensor", f"got {cu.dtype} {list(cu.shape)}")
        if cu.device != q.device:
            raise PackedSeqParamsError(name, "must be on the tensors' device", f"{cu.device} vs {q.device}")
        padded = getattr(params, f"{name}_padded")
        if padded is not None and padded.shape != cu.shape:
            raise PackedSeqParamsError(f"{name}_padded", "shape differs from its unpadded twin")
        layout_name = f"{name}_padded" if padded is not None else name
        if layout_name in host and host[layout_name][-1] > rows:
            raise PackedSeqParamsError(
                layout_name, "last offset exceeds the tensor's rows", f"{host[layout_name][-1]} > {rows}"
            )
    if params.cu_seqlens_kv.shape != params.cu_seqlens_q.shape:
        raise PackedSeqParamsError("cu_seqlens_kv", "q/kv capacity mismatch")


Window = tuple[int, int]


def _check_options(
    q: Tensor, causal: bool, window: Any, softcap: Any, sinks: Any
) -> tuple[bool, Window | None, float | None]:
    """Checks ``window``, ``softcap`` and ``sinks`` (host values only) and returns ``(causal, window, softcap)`` in
    one canonical form: ``window`` is None unless it bounds something, and then its ``right`` is 0 exactly when
    the attention is causal (``(left, 0)`` without ``causal`` is causal); ``softcap`` is a float or None."""
    if window is not None:
        if (
            not isinstance(window, (tuple, list))
            or len(window) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= -1 for w in window)
        ):
            raise ValueError(f"varlen_attention: window must be None or (left, right), two ints >= -1, got {window!r}")
        left, right = int(window[0]), int(window[1])
        if causal or right == 0:
            causal, right = True, 0
        window = None if left == -1 and right in (-1, 0) else (left, right)
    if softcap is not None:
        if not isinstance(softcap, numbers.Real) or isinstance(softcap, bool) or not 0 < softcap < math.inf:
            raise ValueError(f"varlen_attention: softcap must be None or a finite number > 0, got {softcap!r}")
        softcap = float(softcap)
    if sinks is not None:
        if not isinstance(sinks, Tensor) or sinks.dim() != 1 or sinks.shape[0] != q.shape[1]:
            shape = list(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
            raise ValueError(
                f"varlen_attention: sinks must be a 1-D tensor of one logit per query head ({q.shape[1]}), got {shape}"
            )
        if not sinks.is_floating_point():
            raise ValueError(f"varlen_attention: sinks must be floating point, got {sinks.dtype}")
        if sinks.device != q.device:
            raise ValueError(f"varlen_attention: sinks must be on q's device ({q.device}), got {sinks.device}")
    return causal, window, softcap


# ---------------------------------------------------------------------------------------------------- reference
def varlen_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    packed_seq_params: PackedSeqParams,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Exact varlen attention with a block-diagonal (causal, windowed) mask built on the device.

    Same contract and options as :func:`varlen_attention` (module docstring). Sequences stay apart as in FlashAttention:
    each sequence's output and gradients read only its own rows, so NaN/Inf in another sequence or in dead rows
    never reaches it, and dead rows still get exact zeros; within a sequence a non-finite value spreads only
    along the pairs the (causal) mask allows. Computes in the input dtype, upcast to float32 for half types.
    Memory is O(Hq * Tq * Tk): meant for tests, CPU training with small T, and shapes FlashAttention does not
    take. Differentiable once (no double backward); graph-safe (no host sync).
    """
    _check_inputs(q, k, v, packed_seq_params)
    causal, window, softcap = _check_options(q, causal, window, softcap, sinks)
    return _reference_attention(
        q,
        k,
        v,
        packed_seq_params,
        causal=causal,
        softmax_scale=softmax_scale,
        window=window,
        softcap=softcap,
        sinks=sinks,
    )


def _reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    packed_seq_params: PackedSeqParams,
    *,
    causal: bool,
    softmax_scale: float | None,
    window: Window | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """The reference on checked inputs and canonical options (:func:`_check_options`)."""
    rows_q, rows_k = _row_layouts(q, k, packed_seq_params)
    visible = (rows_q.slot[:, None] == rows_k.slot[None, :]) & rows_q.live[:, None] & rows_k.live[None, :]
    if causal or window is not None:
        # Bottom-right alignment (FA2): shift = len_kv - len_q of the query's own sequence.
        len_kv_of_q_slot = torch.cat([_lengths(packed_seq_params.cu_seqlens_kv), rows_q.length.new_zeros(1)])
        shift = len_kv_of_q_slot.gather(0, rows_q.slot) - rows_q.length
    if causal:
        visible = visible & (rows_k.pos[None, :] <= (rows_q.pos + shift)[:, None])
    if window is not None:
        # Key j of query i sits at j - (i + shift) from the query's diagonal: at most left before it, right after.
        offset = rows_k.pos[None, :] - (rows_q.pos + shift)[:, None]
        left, right = window
        if left >= 0:
            visible = visible & (offset >= -left)
        if right >= 0 and not causal:
            visible = visible & (offset <= right)

    compute = torch.float32 if q.dtype in _FLASH_DTYPES else q.dtype
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    # Autocast off: the reference computes in ``compute`` as FlashAttention does inside (an autocast matmul would
    # run in bf16, and the finfo.min fill would not even fit).
    with torch.autocast(q.device.type, enabled=False):
        qh = q.to(compute).reshape(tq, hkv, hq // hkv, d).permute(1, 2, 0, 3)  # [Hkv, G, Tq, D]
        kh = k.to(compute).permute(1, 0, 2)  # [Hkv, Tk, D]
        vh = v.to(compute).permute(1, 0, 2)
        if softcap is None and sinks is None:
            out = _IsolatedAttention.apply(qh, kh, vh, visible, scale)  # [Hkv, G, Tq, D]
        else:
            sink = None if sinks is None else sinks.to(compute).reshape(hkv, hq // hkv, 1, 1)
            out = _IsolatedAttention.apply(qh, kh, vh, visible, scale, softcap, sink)
    return out.permute(2, 0, 1, 3).reshape(tq, hq, d).to(q.dtype)


def _visible_matmul(a: Tensor, b: Tensor, visible: Tensor) -> Tensor:
    """``a @ b`` for ``a [..., M, K]`` that is exactly zero wherever ``visible [M, K]`` (0./1.) is 0.

    A plain matmul lets 0 x NaN at an invisible pair poison the output (another document's row, a dead row). Here a
    row ``k`` of ``b`` holding NaN/Inf makes output row ``m`` NaN only when the pair ``(m, k)`` is visible. Fixed
    shapes, selections only: no host sync, graph-safe.
    """
    finite = torch.isfinite(b)
    out = a @ torch.where(finite, b, 0)
    # Per output row: does a visible pair meet a non-finite row of b? One small GEMM, [..., K] x [K, M].
    hits = (~finite).any(dim=-1).to(visible.dtype) @ visible.transpose(0, 1)
    return torch.where(hits[..., None] > 0, math.nan, out)


class _IsolatedAttention(torch.autograd.Function):
    """Masked softmax attention on ``[Hkv, G, Tq, D]`` x ``[Hkv, Tk, D]`` whose outputs and grads read a
    (query, key) pair only where ``visible [Tq, Tk]`` allows it: NaN/Inf in one document, or in dead rows, never
    reaches another document, and rows that see no key get exact zeros.

    Options: ``softcap`` (a float) caps the scaled scores at ``softcap * tanh(scores / softcap)``; ``sink``
    (``[Hkv, G, 1, 1]``, one logit per query head) joins every row's softmax denominator without a value.

    Autograd through a masked softmax cannot give this: its backward multiplies structural zeros by other rows'
    values (0 x NaN = NaN). The backward is written by hand so that every such product is a selection or a
    :func:`_visible_matmul`.
    """

    @staticmethod
    def forward(
        ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        visible: Tensor,
        scale: float,
        softcap: float | None = None,
        sink: Tensor | None = None,
    ) -> Tensor:
        hidden = ~visible
        visible_f = visible.to(q.dtype)
        scores = (q @ k[:, None].transpose(-1, -2)).mul_(scale)  # [Hkv, G, Tq, Tk]: each reads one q and one k row
        if softcap is not None:
            scores.div_(softcap).tanh_().mul_(softcap)
        # A finite fill, not -inf: a row with no visible key gets a uniform softmax that the second fill zeroes.
        scores.masked_fill_(hidden, torch.finfo(scores.dtype).min)
        if sink is None:
            probs = torch.softmax(scores, dim=-1).masked_fill_(hidden, 0.0)
            sink_probs = None
        else:
            # softmax over the row's scores and its sink: the row's max (at least the sink) keeps exp() finite, and
            # a row with no visible key puts all its mass on the sink (its filled scores' exp() underflows to 0).
            if scores.shape[-1]:
                top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
            else:  # no key row at all (amax refuses an empty dim)
                top = sink.expand(*scores.shape[:-1], 1)
            probs = scores.sub_(top).exp_()
            sink_probs = (sink - top).exp_()  # [Hkv, G, Tq, 1]
            total = probs.sum(dim=-1, keepdim=True).add_(sink_probs)
            probs = probs.div_(total).masked_fill_(hidden, 0.0)
            sink_probs = sink_probs.div_(total)
        out = _visible_matmul(probs, v[:, None], visible_f)
        ctx.save_for_backward(q, k, v, hidden, visible_f, probs, out, sink_probs)
        ctx.scale = scale
        ctx.softcap = softcap
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout: Tensor):
        q, k, v, hidden, visible_f, probs, out, sink_probs = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        need_sink = sink_probs is not None and ctx.needs_input_grad[6]
        dq = dk = dv = dsink = None
        with torch.autocast(dout.device.type, enabled=False):
            seen_by = visible_f.transpose(0, 1)  # [Tk, Tq]: which queries each key reaches
            if need_v:
                dv = _visible_matmul(probs.transpose(-1, -2), dout, seen_by).sum(dim=1)
            if need_q or need_k or need_sink:
                # rowsum(dout * out) is the softmax backward's per-row term (the sink has no value: it adds no
                # term of its own). The fill selects the visible pairs rather than trusting probs' zeros: dead
                # rows' dout and other documents' v reach dprobs there.
                row_term = (dout * out).sum(dim=-1, keepdim=True)
            if need_sink:
                # d sink = -p_sink * rowsum(dout * out) per row, summed over the rows that see a key: the others
                # (dead rows among them, whose dout may be anything) output 0 and give the sink nothing.
                sees_any = (visible_f.sum(dim=-1) > 0)[:, None]  # [Tq, 1]
                dsink = torch.where(sees_any, sink_probs * row_term, 0).sum(dim=2, keepdim=True).neg_()
            if need_q or need_k:
                dprobs = dout @ v[:, None].transpose(-1, -2)  # each entry reads one dout and one v row
                dscores = dprobs.sub_(row_term).mul_(probs)
                if ctx.softcap is not None:
                    # d(c * tanh(x / c)) / dx = 1 - tanh(x / c)^2, recomputed rather than kept from the forward;
                    # the fill below also drops what other documents' rows make of it.
                    tanh = (q @ k[:, None].transpose(-1, -2)).mul_(ctx.scale).div_(ctx.softcap).tanh_()
                    dscores.mul_(tanh.square_().neg_().add_(1.0))
                dscores.masked_fill_(hidden, 0.0)
                if need_q:
                    dq = _visible_matmul(dscores, k[:, None], visible_f).mul_(ctx.scale)
                if need_k:
                    dk = _visible_matmul(dscores.transpose(-1, -2), q, seen_by).sum(dim=1).mul_(ctx.scale)
        return dq, dk, dv, None, None, None, dsink


def _lengths(cu: Tensor) -> Tensor:
    cu = cu.long()
    return cu[1:] - cu[:-1]


# ---------------------------------------------------------------------------------------------------- FA2 path
class _VarlenAPI:
    """How to call one torch version's ``varlen_attn``; built once from its signature.

    torch 2.10 takes ``is_causal``; 2.11 takes ``window_size`` ((-1, 0) is causal; a sliding window otherwise)
    and ``scale``; 2.12+ adds ``enable_gqa``. A plain class (not a frozen dataclass, not behind ``lru_cache``) so
    that torch.compile can trace through it: dynamo failed on the frozen-dataclass attribute access.
    """

    def __init__(self, fn: Callable[..., Tensor], causal_kw: str, has_scale: bool, has_enable_gqa: bool) -> None:
        self.fn = fn
        self.causal_kw = causal_kw
        self.has_scale = has_scale
        self.has_enable_gqa = has_enable_gqa

    @classmethod
    def from_function(cls, fn: Callable[..., Tensor]) -> _VarlenAPI:
        names = inspect.signature(fn).parameters
        if "window_size" in names:
            causal_kw = "window_size"
        elif "is_causal" in names:
            causal_kw = "is_causal"
        else:
            raise RuntimeError(f"varlen_attn{inspect.signature(fn)} takes neither window_size nor is_causal")
        return cls(fn, causal_kw, "scale" in names, "enable_gqa" in names)

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cu_q: Tensor,
        cu_k: Tensor,
        max_q: int,
        max_k: int,
        *,
        causal: bool,
        softmax_scale: float | None,
        window: Window | None = None,
    ) -> Tensor:
        kwargs: dict[str, Any] = {}
        if self.causal_kw == "window_size":
            # A canonical window (_check_options) already has right == 0 when causal.
            kwargs["window_size"] = window if window is not None else (-1, 0) if causal else (-1, -1)
        elif window is not None:
            raise NotImplementedError(_NEEDS_WINDOW_SIZE)
        else:
            kwargs["is_causal"] = causal
        group = q.shape[1] // k.shape[1]
        if group > 1:
            if self.has_enable_gqa:
                kwargs["enable_gqa"] = True
                max_q = gqa_max_seqlen_q(max_q)
            else:
                k, v = _repeat_kv(k, group), _repeat_kv(v, group)
        if softmax_scale is not None:
            if self.has_scale:
                kwargs["scale"] = float(softmax_scale)
            else:
                # The kernel's own scale is 1/sqrt(D); fold the ratio into q.
                q = q * (float(softmax_scale) * math.sqrt(q.shape[-1]))
        return self.fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def _repeat_kv(x: Tensor, group: int) -> Tensor:
    t, h, d = x.shape
    return x[:, :, None, :].expand(t, h, group, d).reshape(t, h * group, d)


def _detect_torch_varlen_api() -> _VarlenAPI | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return _VarlenAPI.from_function(varlen_attn)


_TORCH_VARLEN_API = _detect_torch_varlen_api()  # detected once, at import

_MIN_TORCH_FOR_WINDOW = "2.11"
_NEEDS_WINDOW_SIZE = (
    f"varlen_attention: window on CUDA fp16/bf16 needs torch >= {_MIN_TORCH_FOR_WINDOW} (varlen_attn's window_size); "
    f"this is torch {torch.__version__}. Upgrade torch, or pass float32 tensors to use the exact (O(T^2)) reference."
)


def _torch_varlen_api() -> _VarlenAPI | None:
    return _TORCH_VARLEN_API


def flash_offsets(packed_seq_params: PackedSeqParams) -> tuple[Tensor, Tensor]:
    """The (q, kv) offsets FlashAttention runs on: int32, built on the device, fixed shape.

    Without padded twins these are ``cu_seqlens_q`` / ``cu_seqlens_kv``. With them, a kernel that only knows
    contiguous segments cannot skip padding, so each side becomes ``2 * capacity + 1`` interleaved offsets
    ``[p0, p0 + l0, p1, p1 + l1, ..., p_n]``: real and padding segments alternate, padding segments attend
    only among themselves, and their rows are zeroed afterwards. Exact for causal and non-causal alike.
    """

    def interleave(which: str) -> Tensor:
        layout = packed_seq_params.layout_offsets(which)
        cu = getattr(packed_seq_params, f"cu_seqlens_{which}")
        starts = layout[:-1]
        ends = starts + (cu[1:] - cu[:-1])
        return torch.cat([torch.stack([starts, ends], dim=1).reshape(-1), layout[-1:]])

    p = packed_seq_params
    if p.cu_seqlens_q_padded is None and p.cu_seqlens_kv_padded is None:
        return p.cu_seqlens_q, p.cu_seqlens_kv
    cu_q = interleave("q")
    return cu_q, (cu_q if _kv_shares_q_offsets(p) else interleave("kv"))


def _zero_dead_rows(x: Tensor, live: Tensor) -> Tensor:
    """``x`` with the rows where ``live`` (bool ``[rows]``) is False set to exact zeros, the others bit for bit.

    A select that broadcasts ``live`` over each row runs on aten's non-vectorized elementwise kernel (so it did on
    the H200, the wrapper's largest cost), which moves one element per thread step. So it selects 8-byte words
    where a row's bytes allow (a quarter of a bf16 tensor's elements): an all-zero word is +0.0 in every floating
    dtype. Not while compiling (Inductor fuses the plain select into its own kernel) nor on a tensor that requires
    grad (a word view has none)."""
    rows = x.shape[0]
    per_word = 8 // x.element_size() if 8 % x.element_size() == 0 else 0
    if (
        # first: Dynamo breaks the graph at ``storage_offset()`` (a torch op returning an int), which would split
        # the compiled layer around this autograd.Function
        not torch.compiler.is_compiling()
        and rows
        and per_word
        and x.is_contiguous()
        and (x.numel() // rows) % per_word == 0
        and x.storage_offset() % per_word == 0
        and not x.requires_grad
    ):
        words = x.view(rows, -1).view(torch.int64)
        return torch.where(live[:, None], words, 0).view(x.dtype).view(x.shape)
    return torch.where(live.view(-1, *[1] * (x.dim() - 1)), x, 0)


class _ZeroDeadRowGrad(torch.autograd.Function):
    """Identity forward; the backward zeroes the gradient of dead rows.

    FlashAttention never writes dq/dk/dv rows outside its segments (the tail) nor rows past ``max_seqlen``
    in an over-long padding segment: those hold uninitialised memory, possibly NaN. ``where`` (not a
    multiply) replaces them with exact zeros.
    """

    @staticmethod
    def forward(ctx, x: Tensor, live: Tensor) -> Tensor:
        ctx.save_for_backward(live)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (live,) = ctx.saved_tensors
        return _zero_dead_rows(grad, live), None


def _flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    params: PackedSeqParams,
    *,
    causal: bool,
    softmax_scale: float | None,
    api: _VarlenAPI,
    window: Window | None = None,
) -> Tensor:
    """FA2 on checked inputs and a canonical window (:func:`_check_options`) that :func:`_flash_takes_window`
    accepts."""
    for name in ("max_seqlen_q", "max_seqlen_kv"):
        if not isinstance(getattr(params, name), int):
            raise PackedSeqParamsError(name, "required (a static Python int) for FlashAttention")
    if window is not None and api.causal_kw != "window_size":
        raise NotImplementedError(_NEEDS_WINDOW_SIZE)
    grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if _short_docs_apply(q, k, params, causal):
        rows_q = row_layout(params, "q", q.shape[0])
        flash = functools.partial(
            _run_flash, params=params, causal=causal, softmax_scale=softmax_scale, api=api, grads=grads, window=window
        )
        scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
        return short_and_long_attention(
            q,
            k,
            v,
            params.cu_seqlens_q,
            rows_q.slot,
            rows_q.length,
            rows_q.live,
            scale=scale,
            flash=flash,
            zero_dead_grad=_ZeroDeadRowGrad.apply,
            window_left=None if window is None else window[0],
        )
    live_q = _live_rows(params, "q", q.shape[0])
    live_k = live_q if _one_layout(q, k, params) else _live_rows(params, "kv", k.shape[0])
    if q.requires_grad:
        q = _ZeroDeadRowGrad.apply(q, live_q)
    if k.requires_grad:
        k = _ZeroDeadRowGrad.apply(k, live_k)
    if v.requires_grad:
        v = _ZeroDeadRowGrad.apply(v, live_k)
    out = _run_flash(
        q,
        k,
        v,
        *flash_offsets(params),
        params=params,
        causal=causal,
        softmax_scale=softmax_scale,
        api=api,
        grads=grads,
        window=window,
    )
    return _ZeroDeadRowsOut.apply(out, live_q)


class _ZeroDeadRowsOut(torch.autograd.Function):
    """Dead rows of FA2's output set to exact zeros; the backward passes the gradient through unchanged.

    The kernel leaves rows outside its segments unwritten (garbage, possibly NaN): select zeros, don't multiply.
    The gradient of those rows needs no zeroing on the way back: FA2's backward never reads a row outside its
    segments, a padding segment's rows reach only the grads of that segment's own rows, and those
    :class:`_ZeroDeadRowGrad` zeroes. One elementwise pass of the output's size fewer than ``torch.where``'s
    backward.
    """

    @staticmethod
    def forward(ctx, out: Tensor, live: Tensor) -> Tensor:
        return _zero_dead_rows(out, live)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _run_flash(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    *,
    params: PackedSeqParams,
    causal: bool,
    softmax_scale: float | None,
    api: _VarlenAPI,
    grads: bool,
    window: Window | None = None,
) -> Tensor:
    """One FA2 varlen call on offsets ``cu_q``/``cu_k`` at ``params``' max_seqlen; dead rows left unwritten."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    # Many slots (ghosts included) would size FA2's backward dq accumulator by the slot count: split it.
    run = flash_attention_slot_chunks if cu_q.numel() - 1 > SLOTS_PER_BACKWARD and grads else api
    max_q, max_k = params.max_seqlen_q, params.max_seqlen_kv
    return run(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, softmax_scale=softmax_scale, window=window)


def _short_docs_apply(q: Tensor, k: Tensor, params: PackedSeqParams, causal: bool) -> bool:
    """Whether :mod:`packgraph.ops.short_docs` runs these offsets: causal self-attention on shared offsets
    without padded twins, of at least ``params.short_docs_min_slots`` slots (None: never). Static: shapes, field
    identity and capacity only. Not under torch.compile, whose tracing of the local path's
    recomputing backward is untested."""
    return (
        causal
        and slot_boundary.short_docs_for(params.cu_seqlens_q.numel() - 1, params.short_docs_min_slots)
        and _one_layout(q, k, params)
        and params.cu_seqlens_q_padded is None
        and not torch.compiler.is_compiling()
    )


def _flash_takes_window(window: Window | None, params: PackedSeqParams) -> bool:
    """Whether FA2 computes this canonical window as documented. FA2 drops a bound that reaches ``max_seqlen_kv``
    (``window_size >= max_seqlen_k`` becomes -1, forward and backward). On the left that changes nothing (such a
    bound passes every key), nor on the right when ``right >= len_q - 1``; a query of a longer q sequence would see
    keys past ``i + shift + right``. Static: decided on ``max_seqlen_q`` (an upper bound of ``len_q``)."""
    if window is None or window[1] < 0:
        return True
    max_q, max_k = params.max_seqlen_q, params.max_seqlen_kv
    if not (isinstance(max_q, int) and isinstance(max_k, int)):
        return True  # _flash_attention refuses them, naming the field
    return window[1] < max_k or max_q <= window[1] + 1


def _flash_eligible(q: Tensor) -> bool:
    d = q.shape[-1]
    return q.is_cuda and q.dtype in _FLASH_DTYPES and d % 8 == 0 and d <= _FLASH_MAX_HEAD_DIM


# ---------------------------------------------------------------------------------------------------- public
def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    packed_seq_params: PackedSeqParams,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    backend: str = "flash",
    mask: tuple[Any, Tensor] | None = None,
) -> Tensor:
    """Attention over packed sequences: ``[Tq, Hq, D]`` x ``[Tk, Hkv, D]`` -> ``[Tq, Hq, D]``.

    See the module docstring for the layout, GQA, dead-row and causal-alignment contract, and for the options.

    Dispatch: CUDA tensors in fp16/bf16 with ``head_dim % 8 == 0`` and ``head_dim <= 256`` run torch's
    FlashAttention-2 varlen op (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10), which has a backward
    and is CUDA-graph capturable; it needs static ``max_seqlen_q`` / ``max_seqlen_kv`` (Python ints) that
    bound every real length. Offsets of more than 512 slots (ghost slots count; padded twins double them) run
    their backward in chunks of slots, 512 then fewer (:mod:`packgraph.ops.flash_chunks`): FA2 sizes a backward
    buffer by the slot count. Causal self-attention on offsets of at least
    ``packed_seq_params.short_docs_min_slots`` slots (129 by default) runs :mod:`packgraph.ops.short_docs`
    instead, whose cost does not grow with the slot count. ``window`` runs on all three (torch >= 2.11); a causal
    window of at most :data:`packgraph.ops.short_docs.BLOCK` keys to the left runs every document of short_docs in
    its local blocks. Everything else runs :func:`varlen_attention_reference`, exact but O(Hq * Tq * Tk) memory:
    other dtypes, head sizes and devices; ``softcap`` and ``sinks`` (FA2 in torch has no softcap, and its backward
    takes no gradient of the logsumexp that sinks need); and a non-causal window whose right bound reaches
    ``max_seqlen_kv`` while ``max_seqlen_q`` exceeds it by more than one (FA2 would drop that bound).

    Args:
        q: ``[Tq, Hq, D]``.
        k, v: ``[Tk, Hkv, D]``, ``Hq % Hkv == 0``, same dtype and device as q.
        packed_seq_params: ``qkv_format="thd"`` params whose offsets live on q's device.
        causal: causal mask within each sequence (bottom-right aligned when q/kv lengths differ).
        softmax_scale: defaults to ``1 / sqrt(D)``.
        window: ``(left, right)`` sliding window in FlashAttention's convention (ints >= -1; -1: unbounded).
        softcap: softcap the scaled scores at ``softcap * tanh(scores / softcap)`` (a finite float > 0).
        sinks: ``[Hq]`` floating tensor on q's device, one sink logit per query head (differentiable).
        backend: ``"flash"`` (the dispatch above) or ``"doc_mask"``: FlexAttention with a document block mask
            built on the device from the offsets (:mod:`packgraph.ops.doc_mask`; compiled on CUDA at its first
            call per shape). Its launch depends on ``T`` only, not on ``max_seqlen`` or the slot count, so one graph
            serves every packing (:func:`~packgraph.buckets.document_mask_buckets`). Self-attention only (``k``'s
            offsets the same tensors as ``q``'s), with ``window`` and ``softcap``; no ``sinks``. On the CPU it runs
            forward passes only (torch's FlexAttention has no CPU backward). The faster of the two for a layer
            shape is measured before capture by :func:`packgraph.choose_attention_backend` (``"auto"`` is refused
            here, naming it).
        mask: ``backend="doc_mask"`` only: the ``(block_mask, live)`` that
            :func:`~packgraph.ops.doc_mask.document_block_mask` built for these params, ``causal`` and ``window``
            (a model whose layers share them builds it once per forward; by default each call builds its own).

    Raises:
        ValueError: bad shapes/dtypes/devices or options (``PackedSeqParamsError`` for the params).
        RuntimeError: the FA2 path is needed but this torch has no ``varlen_attn``.
        NotImplementedError: a window on the FA2 path of torch 2.10 (its ``varlen_attn`` has no ``window_size``).
    """
    _check_inputs(q, k, v, packed_seq_params)
    causal, window, softcap = _check_options(q, causal, window, softcap, sinks)
    if backend == "doc_mask":
        return _document_mask(q, k, v, packed_seq_params, causal, softmax_scale, window, softcap, sinks, mask)
    if mask is not None:
        raise ValueError("varlen_attention: mask is the document mask of backend='doc_mask'; FA2 takes none")
    if backend == "auto":
        # A measurement cannot run inside a call that may be under capture, and the backend decides the buckets.
        raise ValueError(
            "varlen_attention: backend='auto' is chosen once, before capturing, with its bucket policy: "
            "packgraph.choose_attention_backend(T, heads, kv_heads, head_dim, device=...) returns the backend to "
            "pass here (TrainConfig(attention_backend='auto') does it for packgraph train)"
        )
    if backend != "flash":
        raise ValueError(f"varlen_attention: backend must be one of {BACKENDS}, got {backend!r}")
    if _flash_eligible(q) and softcap is None and sinks is None and _flash_takes_window(window, packed_seq_params):
        api = _torch_varlen_api()
        if api is None:
            raise RuntimeError(
                f"varlen_attention on CUDA {q.dtype} needs torch.nn.attention.varlen.varlen_attn "
                f"(torch >= {_MIN_TORCH_FOR_FLASH}); this is torch {torch.__version__}. "
                "Upgrade torch, or pass float32 tensors to use the exact (O(T^2)) reference."
            )
        return _flash_attention(
            q, k, v, packed_seq_params, causal=causal, softmax_scale=softmax_scale, api=api, window=window
        )
    return _reference_attention(
        q,
        k,
        v,
        packed_seq_params,
        causal=causal,
        softmax_scale=softmax_scale,
        window=window,
        softcap=softcap,
        sinks=sinks,
    )


BACKENDS = ("flash", "doc_mask")


def _document_mask(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    params: PackedSeqParams,
    causal: bool,
    softmax_scale: float | None,
    window: tuple[int, int] | None,
    softcap: float | None,
    sinks: Tensor | None,
    mask: tuple[Any, Tensor] | None,
) -> Tensor:
    if sinks is not None:
        raise NotImplementedError("varlen_attention: backend='doc_mask' has no attention sinks; use backend='flash'")
    if not _one_layout(q, k, params):
        raise ValueError(
            "varlen_attention: backend='doc_mask' runs self-attention, whose q and k/v rows share one layout: the "
            "same cu_seqlens tensor for q and kv (and the same padded twin); use backend='flash' for other layouts"
        )
    try:
        return doc_mask_attention(
            q,
            k,
            v,
            params,
            causal=causal,
            softmax_scale=softmax_scale,
            window=window,
            softcap=softcap,
            compiled=q.is_cuda,
            mask=mask,
        )
    except NotImplementedError as exc:
        if q.is_cuda or "backward on CPU" not in str(exc):
            raise
        raise NotImplementedError(
            "varlen_attention: backend='doc_mask' runs forward passes only on the CPU (torch's FlexAttention has "
            "no CPU backward); use backend='flash', or call it under torch.no_grad()"
        ) from exc
