"""Causal self-attention over many slots at a cost that does not grow with the slot count.

FlashAttention-2's varlen grid has one block per 128 rows of ``max_seqlen`` per slot, ghost slots included, and
an empty block still costs its launch. A bucket of 2048 slots at ``max_seqlen=2048`` runs 16 x 2048 blocks per
head for 2048 rows. :func:`short_and_long_attention` splits the documents by length instead:

* **Short** documents (at most :data:`BLOCK` rows) attend in local blocks: the rows are cut into blocks of
  ``BLOCK``, and each block's queries see the keys of their own block and of the one before, masked to their
  own slot and causally. That holds every key a short document's query needs: its document starts less than
  ``BLOCK`` rows before it. The cost is ``O(T * 2 * BLOCK)`` per head, whatever the slot count.
* **Long** documents (more than ``BLOCK`` rows) are at most ``T // (BLOCK + 1)``, and they run in one FA2 call
  on offsets of their own (:func:`long_doc_offsets`): each long document is a segment, and each run of short
  documents between two long ones is one segment too, whose rows are discarded.

Contract (that of ``varlen_attention``, for what it is used on):

* causal self-attention: q and kv share their offsets and their rows, with no padded twins;
* each row takes the output of the path its document belongs to, by ``where``; dead rows come out as zeros;
* the FA2 call's input grads are zeroed outside the long documents' rows (``_ZeroDeadRowGrad``: FA2 leaves
  rows past a segment's ``max_seqlen`` unwritten). The local path's are exact zeros outside the short documents'
  rows without a mask (:class:`_LocalRecomputed`), so the sum autograd forms of the two is each row's own
  gradient, exactly;
* unlike one FA2 call, the local path reads every row of a block and of the one before, dead rows too: their
  q/k/v must be finite (a NaN there reaches the short documents beside it through the mask's ``-inf``). They are
  in a model whose dead rows hold real tokens, or the zeros an earlier attention layer writes there;
* graph-safe: both paths have fixed shapes (``T``, :data:`BLOCK`, the long-document bound) and no host read;
* a causal sliding window of ``left`` keys (FA2's ``window=(left, 0)``) narrows the local mask to rows at most
  ``left`` before the query and goes to the FA2 call. With ``left <= BLOCK`` every query's keys lie in its block
  and the one before, whatever its document's length: then every document takes the local path and there is no
  FA2 call;
* memory: the local path keeps nothing of its own for the backward but its additive mask (``T * 2 * BLOCK``
  elements of q's dtype); its backward recomputes its forward (cheap at this size) from the q/k/v the FA2 call
  keeps anyway. Its windows are overlapping views of the padded k/v, not copies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "BLOCK",
    "long_doc_offsets",
    "long_doc_slots",
    "local_mask",
    "local_block_attention",
    "short_and_long_attention",
]

BLOCK = 128
"""Rows per local block, and the longest document the local path takes: FA2's query block."""

Flash = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
"""``flash(q, k, v, cu_q, cu_k)``: FA2 varlen at the caller's static max_seqlen, dead rows left unwritten."""


def long_doc_slots(n_rows: int) -> int:
    """Slots of :func:`long_doc_offsets` for a stream of ``n_rows`` rows: the long documents and the gaps around
    them, ``2 * (n_rows // (BLOCK + 1)) + 1``."""
    return 2 * (n_rows // (BLOCK + 1)) + 1


def long_doc_offsets(cu: Tensor, n_rows: int) -> Tensor:
    """Offsets (int32, ``long_doc_slots(n_rows) + 1`` of them) that keep each document of ``cu`` longer than
    :data:`BLOCK` as a segment of its own and merge every run of other documents between them into one segment.

    They are the boundaries of ``cu`` next to a long document, plus its first and last offset, in order; the
    unused entries repeat the last offset (ghost slots). ``cu[-1] <= n_rows`` bounds the number of long
    documents. Built on the device: no host read.
    """
    n = cu.numel() - 1
    edged = F.pad((cu[1:] - cu[:-1]) > BLOCK, (1, 1), value=True)  # is_long, with the two ends kept
    keep = edged[:-1] | edged[1:]  # a long document on the left or the right
    rank = torch.cumsum(keep, 0)  # an integer scan: deterministic, and allowed under deterministic mode
    want = torch.arange(1, long_doc_slots(n_rows) + 2, device=cu.device)
    # The boundary of each kept rank; past the last one, the last boundary (ghost slots).
    where = torch.searchsorted(rank, want).clamp_(max=n)
    return cu.gather(0, where).to(torch.int32)


def _windows(x: Tensor, nb: int) -> Tensor:
    """``[nb, 2 * BLOCK, ...]``: block ``b`` of ``x`` then block ``b + 1``, from ``(nb + 1) * BLOCK`` contiguous
    rows. An overlapping view (no copy): its readers must not write it, and its grads are folded by hand
    (:func:`_fold_windows`), since autograd's backward of an overlapping view is a scatter-add."""
    row = x[0].numel()
    return x.as_strided((nb, 2 * BLOCK, *x.shape[1:]), (BLOCK * row, *x.stride()))


def _fold_windows(grad: Tensor) -> Tensor:
    """The grad of the ``nb * BLOCK`` rows after the first block from that of their :func:`_windows`
    ``[nb, 2 * BLOCK, ...]``: row block ``b`` is the second half of window ``b`` and the first of ``b + 1``."""
    nb = grad.shape[0]
    later = F.pad(grad[1:, :BLOCK], (0, 0) * (grad.dim() - 2) + (0, 0, 0, 1))  # window b + 1; none after the last
    return (grad[:, BLOCK:] + later).reshape(nb * BLOCK, *grad.shape[2:])


def _pad_rows(x: Tensor, front: int, back: int, value: float = 0) -> Tensor:
    """``x`` with ``front`` / ``back`` rows of ``value`` around it (dim 0): one kernel, none when both are 0."""
    if not front and not back:
        return x
    return F.pad(x, (0, 0) * (x.dim() - 1) + (front, back), value=value)


def local_mask(slot: Tensor, dtype: torch.dtype, window_left: int | None = None) -> Tensor:
    """``[nb, 1, BLOCK, 2 * BLOCK]`` additive mask of ``dtype`` (0 or -inf): which key of its window (the block
    before, then its own) each row of a block sees: the same slot, not after it, and with ``window_left`` not more
    than that many rows before it. From the rows' ``slot`` (int64 ``[T]``). Additive, so that the attention's
    forward and its recomputation do not each convert a bool one."""
    t = slot.shape[0]
    nb = -(-t // BLOCK)
    # Padding rows: -1 after the stream (they see each other: finite, and discarded), -2 before it (never seen).
    padded = _pad_rows(_pad_rows(slot, 0, nb * BLOCK - t, -1), BLOCK, 0, -2)
    same = padded[BLOCK:].view(nb, BLOCK, 1) == _windows(padded, nb)[:, None, :]
    # Key j of a window is row j - BLOCK of the block's own numbering: seen by rows i >= j - BLOCK.
    causal = torch.ones(BLOCK, 2 * BLOCK, dtype=torch.bool, device=slot.device).tril_(BLOCK)
    if window_left is not None:  # and j - BLOCK >= i - window_left
        causal.triu_(BLOCK - window_left)
    return torch.where(same & causal, torch.zeros((), dtype=dtype, device=slot.device), float("-inf"))[:, None]


def _block_views(q: Tensor, k: Tensor, v: Tensor, nb: int) -> tuple[Tensor, Tensor, Tensor]:
    """q as ``[nb, Hq, BLOCK, D]`` blocks, k/v as ``[nb, Hq, 2 * BLOCK, D]`` windows (kv heads repeated for GQA)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    if hkv != hq:
        k, v = (x[:, :, None].expand(t, hkv, hq // hkv, d).reshape(t, hq, d) for x in (k, v))
    back = nb * BLOCK - t
    qb = _pad_rows(q, 0, back).view(nb, BLOCK, hq, d).transpose(1, 2)
    kw, vw = (_windows(_pad_rows(x, BLOCK, back), nb).transpose(1, 2) for x in (k, v))
    return qb, kw, vw


def _from_blocks(x: Tensor, t: int) -> Tensor:
    """``[T, H, D]`` rows from ``[nb, H, BLOCK, D]`` blocks."""
    nb, h, _, d = x.shape
    return x.transpose(1, 2).reshape(nb * BLOCK, h, d)[:t]


def local_block_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, scale: float) -> Tensor:
    """Causal attention of each row over the rows of its own slot within its :data:`BLOCK` and the one before:
    ``[T, Hq, D]`` from q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` and :func:`local_mask` of the rows' slots.

    Exact attention for every row whose document has at most ``BLOCK`` rows; the other rows get a finite value
    (a row always sees itself) that the caller discards. For grads use :class:`_LocalRecomputed`: autograd's
    backward of its overlapping windows would be a scatter-add.
    """
    qb, kw, vw = _block_views(q, k, v, mask.shape[0])
    return _from_blocks(F.scaled_dot_product_attention(qb, kw, vw, attn_mask=mask, scale=scale), q.shape[0])


class _LocalRecomputed(torch.autograd.Function):
    """:func:`local_block_attention` whose backward recomputes its forward: it saves only its inputs (which
    the FA2 call of the same layer keeps anyway) and the mask, not the blocks and windows.

    The grads of a row that no query of another row sees and whose own output grad is zero (a long document's,
    a dead row's: the caller selects this path's output on short documents only) are exact zeros, so they need
    no masking: every term of them is a product with a zero output grad or with a masked probability of zero.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(q, k, v, mask)
        ctx.scale = scale
        return local_block_attention(q, k, v, mask, scale=scale)

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, mask = ctx.saved_tensors
        t, hq, d = q.shape
        hkv = k.shape[1]
        need = ctx.needs_input_grad[:3]
        nb = mask.shape[0]
        blocks = [x.detach().requires_grad_(n) for x, n in zip(_block_views(q, k, v, nb), need, strict=True)]
        wanted = [x for x in blocks if x.requires_grad]
        if not wanted:
            return None, None, None, None, None
        with torch.enable_grad():
            out = F.scaled_dot_product_attention(*blocks, attn_mask=mask, scale=ctx.scale)
        grad_blocks = _pad_rows(grad, 0, nb * BLOCK - t).view(nb, BLOCK, hq, d).transpose(1, 2)
        got = iter(torch.autograd.grad(out, wanted, grad_blocks))
        dq = _from_blocks(next(got), t) if need[0] else None
        dkv = []
        for n in need[1:]:
            if not n:
                dkv.append(None)
                continue
            g = _fold_windows(next(got).transpose(1, 2))[:t]
            dkv.append(g if hkv == hq else g.view(t, hkv, hq // hkv, d).sum(2))
        return dq, *dkv, None, None


def short_and_long_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu: Tensor,
    slot: Tensor,
    length: Tensor,
    live: Tensor,
    *,
    scale: float,
    flash: Flash,
    zero_dead_grad: Callable[[Tensor, Tensor], Tensor],
    window_left: int | None = None,
) -> Tensor:
    """Causal self-attention of the documents of ``cu`` (module docstring): ``[T, Hq, D]``.

    ``slot``, ``length`` and ``live`` are the rows' layout (``row_layout``); ``flash`` runs FA2 on the long
    documents' offsets (with the caller's window); ``zero_dead_grad(x, keep)`` is the identity whose backward
    zeroes the rows not in ``keep``; ``window_left``: the causal window's left bound (None: unbounded).
    """
    local_only = window_left is not None and window_left <= BLOCK
    if not local_only:
        # Without padded twins the only dead rows are the tail, whose length reads 0: never long.
        is_long = length > BLOCK
        cu_long = long_doc_offsets(cu, q.shape[0])
        out_long = flash(*(zero_dead_grad(t, is_long) if t.requires_grad else t for t in (q, k, v)), cu_long, cu_long)
    mask = local_mask(slot, q.dtype, window_left)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out_short = _LocalRecomputed.apply(q, k, v, mask, scale)
    else:
        out_short = local_block_attention(q, k, v, mask, scale=scale)
    if local_only:
        return torch.where(live[:, None, None], out_short, 0)
    # FA2 leaves the short documents' rows of its call unwritten or wrong: select, don't add.
    return torch.where(is_long[:, None, None], out_long, torch.where(live[:, None, None], out_short, 0))
