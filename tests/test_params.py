"""PackedSeqParams: construction, the graph-contract round trip, seq_idx, views, HF kwargs."""

import pytest
import torch

from packgraph import PackedSeqParams, PackedSeqParamsError
from packgraph.params import DYNAMIC_FIELDS


def naive_offsets(lengths, capacity):
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    while len(offs) < capacity + 1:
        offs.append(offs[-1])
    return offs


def test_from_seqlens_ghost_slots_repeat_last_offset():
    p = PackedSeqParams.from_seqlens([3, 0, 5], capacity=6)
    assert p.cu_seqlens_q.tolist() == naive_offsets([3, 0, 5], 6) == [0, 3, 3, 8, 8, 8, 8]
    assert p.cu_seqlens_q.dtype == torch.int32
    assert p.capacity == 6
    assert p.max_seqlen_q == p.max_seqlen_kv == 5
    assert p.total_tokens == 8
    assert p.cu_seqlens_q_padded is None


def test_from_seqlens_pad_to_multiple_fills_padded_twins():
    p = PackedSeqParams.from_seqlens([3, 0, 5, 8], capacity=5, pad_to_multiple=4, total_tokens=32)
    assert p.cu_seqlens_q.tolist() == [0, 3, 3, 8, 16, 16]
    assert p.cu_seqlens_q_padded.tolist() == [0, 4, 4, 12, 20, 20]
    assert p.cu_seqlens_kv_padded.tolist() == p.cu_seqlens_q_padded.tolist()
    padded = p.cu_seqlens_q_padded
    assert bool(((padded[1:] - padded[:-1]) % 4 == 0).all())
    assert p.total_tokens == 32


def test_from_seqlens_accepts_cpu_tensor_and_rejects_device_tensor():
    p = PackedSeqParams.from_seqlens(torch.tensor([2, 7]))
    assert p.cu_seqlens_q.tolist() == [0, 2, 9]
    with pytest.raises(PackedSeqParamsError, match="host-side"):
        PackedSeqParams.from_seqlens(torch.tensor([2, 7], device="meta"))


@pytest.mark.parametrize(
    "kwargs, field, rule",
    [
        (dict(lengths=[3, 4], capacity=1), "cu_seqlens_q", "more sequences than capacity"),
        (dict(lengths=[3, -1]), "cu_seqlens_q", "lengths must be >= 0"),
        (dict(lengths=[3, 4], max_seqlen=3), "max_seqlen_q", "below a real sequence length"),
        (dict(lengths=[3, 4], total_tokens=6), "cu_seqlens_q", "last offset exceeds total_tokens"),
        (dict(lengths=[3, 4], pad_to_multiple=0), "cu_seqlens_q_padded", "pad_to_multiple must be >= 1"),
    ],
)
def test_from_seqlens_rejects(kwargs, field, rule):
    lengths = kwargs.pop("lengths")
    with pytest.raises(PackedSeqParamsError) as e:
        PackedSeqParams.from_seqlens(lengths, **kwargs)
    assert e.value.field == field and e.value.rule == rule
    assert field in str(e.value)


def i32(*v):
    return torch.tensor(v, dtype=torch.int32)


@pytest.mark.parametrize("pad", [1, 4])
def test_graph_inputs_signature_round_trip(pad):
    group = object()
    p = PackedSeqParams.from_seqlens([5, 1, 0, 9], capacity=7, pad_to_multiple=pad, total_tokens=40)
    p = p.replace(local_cp_size=2, cp_group=group).with_seq_idx()
    inputs, sig = p.graph_inputs(), p.static_signature()
    assert set(inputs) <= set(DYNAMIC_FIELDS) | {"seq_idx"}
    assert all(isinstance(t, torch.Tensor) for t in inputs.values())
    q = PackedSeqParams.from_graph_inputs({k: v.clone() for k, v in inputs.items()}, sig)
    assert q.equals(p)
    assert q.cp_group is group
    for name in ("qkv_format", "max_seqlen_q", "max_seqlen_kv", "local_cp_size", "total_tokens"):
        assert getattr(q, name) == getattr(p, name)
    q.validate(sync=True)


def test_from_graph_inputs_rejects_mismatch():
    p = PackedSeqParams.from_seqlens([5, 1], capacity=4)
    sig = p.static_signature()
    with pytest.raises(PackedSeqParamsError, match="missing from graph inputs"):
        PackedSeqParams.from_graph_inputs({"cu_seqlens_q": p.cu_seqlens_q}, sig)
    bad = dict(p.graph_inputs(), cu_seqlens_kv=i32(0, 5, 6))
    with pytest.raises(PackedSeqParamsError, match="does not match the signature"):
        PackedSeqParams.from_graph_inputs(bad, sig)


def naive_seq_idx(layout_offsets, total):
    out = []
    for row in range(total):
        idx = len(layout_offsets) - 1
        for i in range(len(layout_offsets) - 1):
            if layout_offsets[i] <= row < layout_offsets[i + 1]:
                idx = i
                break
        out.append(idx)
    return out


@pytest.mark.parametrize("pad", [1, 4])
def test_seq_idx_matches_naive_and_is_deterministic(pad):
    p = PackedSeqParams.from_seqlens([3, 0, 6, 1], capacity=6, pad_to_multiple=pad, total_tokens=24)
    a, b = p.with_seq_idx().seq_idx, p.with_seq_idx().seq_idx
    assert a.shape == (1, 24) and a.dtype == torch.int32
    assert torch.equal(a, b)
    assert a[0].tolist() == naive_seq_idx(p.layout_offsets("q").tolist(), 24)
    # Identical params built twice give identical seq_idx.
    p2 = PackedSeqParams.from_seqlens([3, 0, 6, 1], capacity=6, pad_to_multiple=pad, total_tokens=24)
    assert torch.equal(p2.with_seq_idx().seq_idx, a)
    with pytest.raises(PackedSeqParamsError, match="total_tokens"):
        p.replace(total_tokens=None).with_seq_idx()


def test_attention_view_strips_mamba_fields_only():
    p = PackedSeqParams.from_seqlens([3, 4], capacity=4, total_tokens=9).with_seq_idx()
    v = p.attention_view()
    assert v.total_tokens is None and v.seq_idx is None
    assert v.cu_seqlens_q is p.cu_seqlens_q and v.max_seqlen_q == p.max_seqlen_q
    other = PackedSeqParams.from_seqlens([3, 4], capacity=4, total_tokens=12).with_seq_idx()
    assert other.attention_view().static_signature() == v.static_signature()


def test_hf_kwargs_round_trip_and_static_max_lengths():
    p = PackedSeqParams.from_seqlens([3, 4], capacity=4)
    kw = p.to_hf_kwargs()
    assert set(kw) == {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    q = PackedSeqParams.from_hf_kwargs(kw)
    assert q.equals(p.replace(total_tokens=None))
    with pytest.raises(PackedSeqParamsError, match="Python int"):
        PackedSeqParams.from_hf_kwargs(dict(kw, max_length_q=torch.tensor(4)))
    with pytest.raises(PackedSeqParamsError, match="not representable"):
        PackedSeqParams.from_seqlens([3], pad_to_multiple=4).to_hf_kwargs()


def test_to_keeps_shared_tensors_shared():
    p = PackedSeqParams.from_seqlens([3, 4], capacity=4, pad_to_multiple=2)
    m = p.to("meta")
    assert m.cu_seqlens_q is m.cu_seqlens_kv and m.cu_seqlens_q_padded is m.cu_seqlens_kv_padded
    assert m.device.type == "meta"


# Issue #31 item 7: lengths that are not whole numbers, or whose offsets int32 cannot hold, are refused by a one-line
# PackedSeqParamsError naming ``lengths``, not truncated or left to fail inside int() or torch.tensor.
@pytest.mark.parametrize(
    "lengths, kwargs, rule, shown",
    [
        ([2.7, 3.2], {}, "must be whole numbers", "lengths[0] is 2.7"),
        ([3, 2.5], {}, "must be whole numbers", "lengths[1] is 2.5"),
        (torch.tensor([2.0, 3.5]), {}, "must be whole numbers", "lengths[1] is 3.5"),
        ([float("nan")], {}, "must be whole numbers", "lengths[0] is nan"),
        ([[2, 3]], {}, "must be whole numbers", "lengths[0] is [2, 3]"),
        (torch.tensor([[2, 3]]), {}, "must be 1-D", "shape (1, 2)"),
        (torch.tensor(5), {}, "must be 1-D", "shape ()"),
        (5, {}, "must be a sequence of whole numbers", "got int"),
        ([2**31], {}, "offsets overflow int32", "2147483648 rows"),
        ([2**30, 2**30], {}, "offsets overflow int32", "2147483648 rows"),
        ([2**31 - 2], {"pad_to_multiple": 4}, "offsets overflow int32", "2147483648 rows"),
    ],
)
def test_from_seqlens_rejects_lengths_that_are_not_int32_whole_numbers(lengths, kwargs, rule, shown):
    with pytest.raises(PackedSeqParamsError) as e:
        PackedSeqParams.from_seqlens(lengths, **kwargs)
    assert (e.value.field, e.value.rule) == ("lengths", rule)
    message = str(e.value)
    assert message.startswith("PackedSeqParams.lengths: ") and shown in message and "\n" not in message


def test_from_seqlens_accepts_whole_numbers_of_any_type():
    import numpy as np

    want = [0, 2, 5, 5]
    whole = ([2, 3], [2.0, 3.0], np.array([2, 3]), [np.int64(2), 3], torch.tensor([2.0, 3.0]), (n for n in [2, 3]))
    for lengths in whole:
        assert PackedSeqParams.from_seqlens(lengths, capacity=3).cu_seqlens_q.tolist() == want
    assert PackedSeqParams.from_seqlens([2**31 - 1]).cu_seqlens_q.tolist() == [0, 2**31 - 1]  # the largest that fits
