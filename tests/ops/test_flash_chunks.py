"""The slot-chunked FA2 backward's combination rule, on the CPU: each row takes its grads from its own chunk.

FlashAttention itself needs a GPU (tests/cuda/test_attention_cuda.py compares the chunked backward with the
one-call one there); here a stand-in chunk backward returns the true grads on its chunk's rows and NaN elsewhere,
as FA2's uninitialised outputs may be.
"""

import pytest
import torch

from packgraph.ops.flash_chunks import backward_in_slot_chunks, later_slots


def _cu(lengths, capacity):
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    return torch.tensor(offs + [offs[-1]] * (capacity - len(lengths)), dtype=torch.int32)


@pytest.mark.parametrize(
    "lengths, capacity, per_call",
    [
        ([3, 1, 4, 1, 5, 9, 2, 6], 8, 3),  # chunks of 3, 3, 2 slots
        ([7] * 5 + [1] * 20, 40, 8),  # ghost slots fill the last chunks
        ([2, 0, 0, 5, 0, 1], 6, 2),  # empty slots inside the stream
        ([10], 12, 5),  # one document, the rest ghosts
    ],
)
def test_each_row_takes_its_own_chunks_grads_and_the_tail_is_zero(lengths, capacity, per_call):
    rows, heads, dim = sum(lengths) + 3, 2, 4  # 3 tail rows in no slot
    g = torch.Generator().manual_seed(0)
    true = [torch.randn(rows, heads, dim, generator=g, dtype=torch.float64) for _ in range(3)]
    cu = _cu(lengths, capacity)
    calls = []

    def chunk(sub_q, sub_k):
        calls.append((int(sub_q[0]), int(sub_q[-1]), sub_q.numel() - 1))
        inside = torch.zeros(rows, dtype=torch.bool)
        inside[int(sub_q[0]) : int(sub_q[-1])] = True
        return tuple(torch.where(inside[:, None, None], t, torch.nan) for t in true)

    got = backward_in_slot_chunks(chunk, cu, cu, rows, rows, per_call)
    live = torch.zeros(rows, dtype=torch.bool)
    live[: int(cu[-1])] = True
    for t, r in zip(got, true, strict=True):
        assert not t.isnan().any()
        torch.testing.assert_close(t[live], r[live], rtol=0, atol=0)
        assert (t[~live] == 0).all()
    # every slot is in exactly one call, in order, and no call holds more than per_call slots
    assert sum(n for *_, n in calls) == capacity and max(n for *_, n in calls) <= per_call
    assert [c[0] for c in calls] == [int(cu[s]) for s in range(0, capacity, per_call)]


def test_q_and_kv_sides_use_their_own_offsets():
    cu_q, cu_k = _cu([2, 3, 1], 4), _cu([4, 1, 5], 4)  # cross-attention shapes: q and kv rows differ
    rows_q, rows_k = 7, 10  # one tail row on the q side
    ones_q, ones_k = torch.ones(rows_q, 1, 1), torch.ones(rows_k, 1, 1)

    def chunk(sub_q, sub_k):
        # 1 + this chunk's first slot, written on its rows (garbage 99 elsewhere)
        tag = 1.0 + float((cu_q[:-1] == sub_q[0]).nonzero()[0])
        in_q = (torch.arange(rows_q) >= sub_q[0]) & (torch.arange(rows_q) < sub_q[-1])
        in_k = (torch.arange(rows_k) >= sub_k[0]) & (torch.arange(rows_k) < sub_k[-1])
        wq = torch.where(in_q[:, None, None], ones_q * tag, 99.0)
        wk = torch.where(in_k[:, None, None], ones_k * tag, 99.0)
        return wq, wk, wk

    dq, dk, dv = backward_in_slot_chunks(chunk, cu_q, cu_k, rows_q, rows_k, 2)
    assert dq.flatten().tolist() == [1, 1, 1, 1, 1, 3, 0]  # slots 0-1 (rows 0-4): chunk 0; slot 2: chunk 1; tail 0
    assert dk.flatten().tolist() == [1] * 5 + [3] * 5 and torch.equal(dk, dv)


def test_calls_after_the_first_take_fewer_slots_and_cover_every_slot_once():
    lengths, capacity = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], 12
    rows = sum(lengths) + 2
    cu = _cu(lengths, capacity)
    calls = []

    def chunk(sub_q, sub_k):
        calls.append(sub_q.numel() - 1)
        return tuple(torch.zeros(rows, 1, 1) for _ in range(3))

    backward_in_slot_chunks(chunk, cu, cu, rows, rows, 5, 3)
    assert calls == [5, 3, 3, 1]


def test_later_calls_make_room_for_the_held_results():
    """At T=2048, 8 query heads of 64 in bf16 the held dq, dk, dv (6 MiB) equal the FA2 buffers of 24 slots."""
    q, k, v = (torch.empty(2048, 8, 64, dtype=torch.bfloat16) for _ in range(3))
    assert later_slots(q, k, v, 512) == 488
    per_slot = 128 * 8 * (64 + 1) * 4
    assert (512 - later_slots(q, k, v, 512)) * per_slot >= 3 * q.numel() * q.element_size()
