"""Host offsets: trusted only while their field holds the very tensor they were read from, unwritten since."""

import pytest
import torch

from packgraph import PackedSeqParams, PackedSeqParamsError


def i32(*v):
    return torch.tensor(v, dtype=torch.int32)


def test_replace_of_dynamic_field_drops_stale_host_offsets():
    p = PackedSeqParams.from_seqlens([3, 4], capacity=4)
    q = p.replace(cu_seqlens_q=i32(0, 1, 2, 7, 7), cu_seqlens_kv=i32(0, 1, 2, 7, 7))
    assert q.host_offsets is None
    with pytest.raises(PackedSeqParamsError, match="below a real sequence length"):
        q.validate()


def test_in_place_write_makes_host_offsets_stale():
    p = PackedSeqParams.from_seqlens([4, 4], total_tokens=8)
    assert p.current_host_offsets() is p.host_offsets
    p.validate()
    p.cu_seqlens_q.copy_(torch.tensor([0, 1, 8], dtype=torch.int32))  # in place: the host copies no longer hold
    assert p.current_host_offsets() is None
    with pytest.raises(PackedSeqParamsError) as e:
        p.validate()  # reads the (CPU) tensors themselves now
    assert (e.value.field, e.value.rule) == ("max_seqlen_q", "below a real sequence length")


def test_directly_assigned_field_of_another_length_makes_host_offsets_stale():
    p = PackedSeqParams.from_seqlens([4, 4], capacity=2, total_tokens=8)
    p.cu_seqlens_q = p.cu_seqlens_kv = i32(0, 1, 8, 8)
    p.cu_seqlens_q_padded = p.cu_seqlens_kv_padded = None
    assert p.current_host_offsets() is None
    with pytest.raises(PackedSeqParamsError, match="below a real sequence length"):
        p.validate()


def test_host_offsets_survive_moves_and_views():
    p = PackedSeqParams.from_seqlens([3, 5], capacity=4, pad_to_multiple=2, total_tokens=10).with_seq_idx()
    assert p.to("cpu").current_host_offsets() is not None
    assert p.attention_view().current_host_offsets() is not None
    from packgraph.buckets import BucketPolicy

    bucketed = BucketPolicy((8, 16), (2, 8)).apply(p)
    assert bucketed.current_host_offsets()["cu_seqlens_q"] == tuple(bucketed.cu_seqlens_q.tolist())
