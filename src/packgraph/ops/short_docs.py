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
* each path's input grads are zeroed outside its own rows (``_ZeroDeadRowGrad``), so the sum autograd forms of
  the two is each row's own gradient, exactly (the other term is an exact zero);
* unlike one FA2 call, the local path reads every row of a block and of the one before, dead rows too: their
  q/k/v must be finite (a NaN there reaches the short documents beside it through the mask's ``-inf``). They are
  in a model whose dead rows hold real tokens, or the zeros an earlier attention layer writes there;
* graph-safe: both paths have fixed shapes (``T``, :data:`BLOCK`, the long-document bound) and no host read;
* memory: the local path keeps nothing of its own for the backward but its bool mask (``T * 2 * BLOCK`` bytes);
  its backward recomputes its forward (cheap at this size) from the q/k/v the FA2 call keeps anyway.
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
    cu = cu.long()
    n = cu.numel() - 1
    is_long = (cu[1:] - cu[:-1]) > BLOCK
    edge = torch.ones(1, dtype=torch.bool, device=cu.device)
    keep = torch.cat([edge, is_long]) | torch.cat([is_long, edge])  # a long document on the left or the right
    rank = torch.cumsum(keep, 0)  # an integer scan: deterministic, and allowed under deterministic mode
    want = torch.arange(1, long_doc_slots(n_rows) + 2, device=cu.device)
    # The boundary of each kept rank; past the last one, the last boundary (ghost slots).
    where = torch.searchsorted(rank, want).clamp_(max=n)
    return cu.gather(0, where).to(torch.int32)


def _blocks(x: Tensor, pad_front: int, pad_back: int, fill: float = 0) -> Tensor:
    """``x`` with ``pad_front`` / ``pad_back`` rows of ``fill`` around it (dim 0); ``x`` itself without."""
    if not pad_front and not pad_back:
        return x
    parts = [x.new_full((pad_front, *x.shape[1:]), fill), x, x.new_full((pad_back, *x.shape[1:]), fill)]
    return torch.cat([p for p in parts if p.shape[0]])


def _windows(x: Tensor, nb: int) -> Tensor:
    """``[nb, 2 * BLOCK, ...]`` from ``(nb + 1) * BLOCK`` rows: block ``b`` then block ``b + 1``."""
    blocks = x.view(nb + 1, BLOCK, *x.shape[1:])
    return torch.cat([blocks[:-1], blocks[1:]], dim=1)


def local_mask(slot: Tensor) -> Tensor:
    """``[nb, 1, BLOCK, 2 * BLOCK]`` bool: which key of its window (the block before, then its own) each row
    of a block sees: the same slot, not after it. From the rows' ``slot`` (int64 ``[T]``)."""
    t = slot.shape[0]
    nb = -(-t // BLOCK)
    back = nb * BLOCK - t
    # Padding rows: -1 after the stream (they see each other: finite, and discarded), -2 before it (never seen).
    slot_q = _blocks(slot, 0, back, -1).view(nb, BLOCK)
    slot_k = _windows(torch.cat([slot.new_full((BLOCK,), -2), _blocks(slot, 0, back, -1)]), nb)
    row_q = torch.arange(nb * BLOCK, device=slot.device).view(nb, BLOCK)
    row_k = _windows(torch.arange(-BLOCK, nb * BLOCK, device=slot.device), nb)
    return ((slot_q[:, :, None] == slot_k[:, None, :]) & (row_k[:, None, :] <= row_q[:, :, None]))[:, None]


def local_block_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, scale: float) -> Tensor:
    """Causal attention of each row over the rows of its own slot within its :data:`BLOCK` and the one before:
    ``[T, Hq, D]`` from q ``[T, Hq, D]``, k/v ``[T, Hkv, D]`` and :func:`local_mask` of the rows' slots.

    Exact attention for every row whose document has at most ``BLOCK`` rows; the other rows get a finite value
    (a row always sees itself) that the caller discards. Differentiable through ``scaled_dot_product_attention``.
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    nb = mask.shape[0]
    back = nb * BLOCK - t
    if hkv != hq:
        k, v = (x[:, :, None].expand(t, hkv, hq // hkv, d).reshape(t, hq, d) for x in (k, v))
    qb = _blocks(q, 0, back).view(nb, BLOCK, hq, d).transpose(1, 2)
    kb, vb = (_windows(_blocks(x, BLOCK, back), nb).transpose(1, 2) for x in (k, v))
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(nb * BLOCK, hq, d)[:t]


class _LocalRecomputed(torch.autograd.Function):
    """:func:`local_block_attention` whose backward recomputes its forward: it saves only its inputs (which
    the FA2 call of the same layer keeps anyway) and the bool mask, not the blocks and windows."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(q, k, v, mask)
        ctx.scale = scale
        return local_block_attention(q, k, v, mask, scale=scale)

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, mask = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        inputs = [t.detach().requires_grad_(n) for t, n in zip((q, k, v), need, strict=True)]
        with torch.enable_grad():
            out = local_block_attention(*inputs, mask, scale=ctx.scale)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (*(next(grads) if n else None for n in need), None, None)


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
) -> Tensor:
    """Causal self-attention of the documents of ``cu`` (module docstring): ``[T, Hq, D]``.

    ``slot``, ``length`` and ``live`` are the rows' layout (``row_layout``); ``flash`` runs FA2 on the long
    documents' offsets; ``zero_dead_grad(x, keep)`` is the identity whose backward zeroes the rows not in
    ``keep``.
    """
    is_long = live & (length > BLOCK)
    is_short = live & ~is_long
    cu_long = long_doc_offsets(cu, q.shape[0])

    def masked(keep: Tensor) -> list[Tensor]:
        return [zero_dead_grad(t, keep) if t.requires_grad else t for t in (q, k, v)]

    out_long = flash(*masked(is_long), cu_long, cu_long)
    mask = local_mask(slot)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out_short = _LocalRecomputed.apply(*masked(is_short), mask, scale)
    else:
        out_short = local_block_attention(q, k, v, mask, scale=scale)
    # FA2 leaves the short documents' rows of its call unwritten or wrong: select, don't add.
    return torch.where(is_long[:, None, None], out_long, torch.where(is_short[:, None, None], out_short, 0))
