"""FlashAttention-2 varlen with its backward split over chunks of slots, for offsets of many slots.

FA2's varlen backward allocates an fp32 dq accumulator of ``total_q + 128 * slots`` rows x heads x head_dim, where
``slots = len(cu_seqlens) - 1`` counts ghost slots too: 516 MiB at T=2048, 8 heads of 64 and 2048 slots, where the
same batch's 545 real documents need 148 MiB at their own count. Above :data:`SLOTS_PER_BACKWARD` slots,
:func:`flash_attention_slot_chunks` runs the backward once per chunk of at most that many slots, so the
accumulator stays at most ``total_q + 128 * SLOTS_PER_BACKWARD`` rows whatever the capacity.

Contract (what makes the split exact):

* Each chunk's call reads the whole q/k/v/out/logsumexp (the offsets are absolute row indices) and writes the
  grads of its own slots' rows only; the rest of its outputs is uninitialised. A slot's rows are one contiguous
  range and slots do not overlap, so each row takes its grads from the one chunk whose ``[cu[first], cu[last])``
  range holds it, by ``where`` (no sum: no rounding, and no NaN from another chunk's garbage). Rows in no chunk
  (the tail) come out as zeros.
* A row's grads are computed from its own sequence only, so they are the values the one-call backward gives
  (tests/cuda/test_flash_chunks_cuda.py compares them on the GPU).
* Graph-safe: the chunks are static slices of the offsets; no host read.
* A sliding window (``window=(left, right)``) goes to the forward and to every chunk's backward: it acts within
  each sequence, so it does not change which rows a chunk writes.

Memory: the first call's grads become the results (its rows outside the chunk zeroed in place) and each later
call's rows are written into them in place, so the results are held while the later calls run. Those calls take
fewer slots (:func:`later_slots`), enough fewer that their accumulator plus the held results is no larger than the
first call's accumulator: the backward's peak is its first call's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "SLOTS_PER_BACKWARD",
    "flash_attention_slot_chunks",
    "backward_in_slot_chunks",
    "later_slots",
    "backward_bytes_per_slot",
    "gqa_max_seqlen_q",
]

# Measured on an H200 (bench/results/2026-12-01-h200-fa-ghosts/, T=2048, 8 heads of 64): at 2048 slots chunks of
# 512 hold the backward to 158 MiB (one call: 530 MiB) for +28% of its time on 545 documents; chunks of 256 hold
# 93 MiB for +56%.
SLOTS_PER_BACKWARD = 512

ChunkBackward = Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]


def _window_kwargs(window: tuple[int, int] | None) -> dict[str, int]:
    # No window: the call as before windows existed (aten's defaults).
    return {} if window is None else {"window_size_left": window[0], "window_size_right": window[1]}


def flash_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale, window):
    """aten's FA2 varlen forward: ``(out, logsumexp, rng_state, unused, debug_mask)``. A module attribute, so that
    the CPU tests can put a stand-in here (tests/ops)."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, **_window_kwargs(window)
    )


def flash_backward(
    grad, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, rng, unused, scale, window
):
    """aten's FA2 varlen backward on the slots of ``cu_q``/``cu_k``: ``(dq, dk, dv)`` (see :func:`flash_forward`)."""
    return torch.ops.aten._flash_attention_backward(
        grad,
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        max_q,
        max_k,
        0.0,
        causal,
        rng,
        unused,
        scale=scale,
        **_window_kwargs(window),
    )


def backward_in_slot_chunks(
    backward: ChunkBackward,
    cu_q: Tensor,
    cu_k: Tensor,
    rows_q: int,
    rows_k: int,
    slots_per_call: int,
    slots_per_later_call: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` from ``backward(sub_cu_q, sub_cu_k)`` run on the first ``slots_per_call`` slots, then on
    chunks of ``slots_per_later_call`` (default: the same).

    ``backward`` must return new grad tensors that are valid on its slots' rows (``[sub[0], sub[-1])`` on each
    side) and may hold anything elsewhere; the first call's are written in place. See the module docstring for why
    combining them by ``where`` is exact.
    """
    slots = cu_q.numel() - 1
    later = slots_per_call if slots_per_later_call is None else slots_per_later_call
    q_rows = torch.arange(rows_q, device=cu_q.device)
    k_rows = q_rows if rows_k == rows_q else torch.arange(rows_k, device=cu_k.device)
    dq = dk = dv = None
    first, size = 0, slots_per_call
    while first < slots:
        last = min(first + size, slots)
        sub_q, sub_k = cu_q[first : last + 1], cu_k[first : last + 1]
        gq, gk, gv = backward(sub_q, sub_k)
        mine_q = ((q_rows >= sub_q[0]) & (q_rows < sub_q[-1]))[:, None, None]
        mine_k = ((k_rows >= sub_k[0]) & (k_rows < sub_k[-1]))[:, None, None]
        if dq is None:
            dq, dk, dv = gq.masked_fill_(~mine_q, 0), gk.masked_fill_(~mine_k, 0), gv.masked_fill_(~mine_k, 0)
        else:
            torch.where(mine_q, gq, dq, out=dq)
            torch.where(mine_k, gk, dk, out=dk)
            torch.where(mine_k, gv, dv, out=dv)
        del gq, gk, gv  # not held through the next call
        first, size = last, later
    return dq, dk, dv


def backward_bytes_per_slot(heads: int, head_dim: int) -> int:
    """What one slot (ghosts too) adds to FA2's varlen backward buffers: its fp32 dq accumulator and softmax sums
    have ``128 * slots`` rows more than the query rows, x query heads x (head_dim rounded up to 32, plus one)."""
    return 128 * heads * (math.ceil(head_dim / 32) * 32 + 1) * 4


def gqa_max_seqlen_q(max_q: int) -> int:
    """The static max_seqlen_q to give FA2 under GQA. FA2 folds query heads into the sequence axis when
    max_seqlen_q == 1, which assumes one row per sequence; the packed stream has more (padding, tail). A larger
    static bound is harmless."""
    return max(max_q, 2)


def later_slots(q: Tensor, k: Tensor, v: Tensor, slots_per_call: int) -> int:
    """Slots per call after the first, for which the call's FA2 backward buffers plus the held results (grads the
    size of q, k and v) are no larger than the first call's buffers (:func:`backward_bytes_per_slot`)."""
    held = sum(t.numel() * t.element_size() for t in (q, k, v))
    return max(1, slots_per_call - math.ceil(held / backward_bytes_per_slot(q.shape[1], q.shape[2])))


class _FlashSlotChunks(torch.autograd.Function):
    """FA2 varlen forward in one call (it has no per-slot buffer); the backward in chunks of slots."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float | None, window=None):
        # As varlen_attn calls these ops: with a window, its right bound (0) is the causal mask, and is_causal is off.
        causal = causal and window is None
        out, lse, rng, unused, _ = flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window)
        ctx.save_for_backward(q, k, v, out, lse, rng, unused, cu_q, cu_k)
        ctx.static = (max_q, max_k, causal, scale, window)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse, rng, unused, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, causal, scale, window = ctx.static
        grad = grad.contiguous()

        def chunk(sub_q: Tensor, sub_k: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            return flash_backward(
                grad, q, k, v, out, lse, sub_q, sub_k, max_q, max_k, causal, rng, unused, scale, window
            )

        later = later_slots(q, k, v, SLOTS_PER_BACKWARD)
        dq, dk, dv = backward_in_slot_chunks(chunk, cu_q, cu_k, q.shape[0], k.shape[0], SLOTS_PER_BACKWARD, later)
        return dq, dk, dv, None, None, None, None, None, None, None


def flash_attention_slot_chunks(
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
    window: tuple[int, int] | None = None,
) -> Tensor:
    """FA2 varlen attention (torch's ``aten._flash_attention_forward``, GQA native) whose backward runs on
    :data:`SLOTS_PER_BACKWARD` slots, then on chunks of :func:`later_slots`. Same inputs and output as
    ``varlen_attn``; rows outside every slot are left unwritten (the caller zeroes them). ``window``: ``(left,
    right)`` in FA2's convention, right 0 when causal (None: no window)."""
    if q.shape[1] != k.shape[1]:
        max_q = gqa_max_seqlen_q(max_q)
    if window is None:  # the call as before windows existed
        return _FlashSlotChunks.apply(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale)
    return _FlashSlotChunks.apply(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window)
