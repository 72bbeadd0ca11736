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


# Issue #31 item 4: a write that keeps the version counter. The params hold one document of 20 rows; the write
# makes it five (0, 20, 25, 30, 35, 40): four more documents, 20 more rows, in slots the host copies call ghosts.
_WRITTEN = [0, 20, 25, 30, 35, 40, 40, 40, 40]


def _write_through_numpy(t):
    t.numpy()[:] = _WRITTEN


def _write_through_data(t):
    t.data.copy_(torch.tensor(_WRITTEN, dtype=torch.int32))


@pytest.mark.parametrize("write", [_write_through_numpy, _write_through_data], ids=["numpy", "data"])
def test_a_write_that_keeps_the_version_makes_cpu_host_offsets_stale(write):
    from packgraph.buckets import BucketPolicy
    from packgraph.ops import varlen_attention

    p = PackedSeqParams.from_seqlens([20], capacity=8, total_tokens=40)
    version = p.cu_seqlens_q._version
    write(p.cu_seqlens_q)  # cu_seqlens_kv is the same tensor
    assert p.cu_seqlens_q._version == version  # the counter cannot tell
    assert p.current_host_offsets() is None  # the values can
    with pytest.raises(PackedSeqParamsError) as e:
        p.validate()  # five valid documents, but a GPU would not have seen them: say so
    assert (e.value.field, e.value.rule) == ("cu_seqlens_q", "host_offsets disagree with the tensor")
    assert "offset 2: host 20, tensor 25" in str(e.value) and "\n" not in str(e.value)
    bucketed = BucketPolicy((20, 40), (1, 8)).apply(p)
    assert bucketed.capacity == 8 and bucketed.cu_seqlens_q.tolist() == _WRITTEN  # no document sliced away
    q = torch.randn(40, 2, 4, dtype=torch.float64)
    ref = PackedSeqParams.from_seqlens([20, 5, 5, 5, 5], capacity=8, total_tokens=40)
    out = varlen_attention(q, q, q, bucketed)
    torch.testing.assert_close(out, varlen_attention(q, q, q, ref))
    assert bool(out[20:].ne(0).any())  # the four written documents' rows are not zeros


def test_a_write_that_keeps_the_version_and_breaks_a_rule_is_rejected():
    p = PackedSeqParams.from_seqlens([4, 4], total_tokens=8)
    p.cu_seqlens_q.numpy()[:] = [0, 1, 8]  # 7 rows in one document; max_seqlen is 4
    with pytest.raises(PackedSeqParamsError) as e:
        p.validate()
    assert (e.value.field, e.value.rule) == ("max_seqlen_q", "below a real sequence length")


def test_cpu_host_offsets_are_compared_once_per_field_build():
    p = PackedSeqParams.from_seqlens(list(range(1, 65)), capacity=128)
    assert p.current_host_offsets() is p.host_offsets
    built = dict(p.host_offsets._cpu_values)
    assert p.current_host_offsets() is p.host_offsets
    assert all(p.host_offsets._cpu_values[k][1] is v[1] for k, v in built.items())  # reused, not rebuilt
