"""PackedSeqParams: construction, every validation rule, the graph-contract round trip, seq_idx, HF kwargs."""

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


def raw(**over):
    """Params built by hand (no host offsets), so validate reads the tensors themselves."""
    base = dict(
        qkv_format="thd",
        cu_seqlens_q=torch.tensor([0, 3, 7, 7], dtype=torch.int32),
        cu_seqlens_kv=torch.tensor([0, 3, 7, 7], dtype=torch.int32),
        max_seqlen_q=4,
        max_seqlen_kv=4,
        total_tokens=8,
    )
    base.update(over)
    return PackedSeqParams(**base)


def i32(*v):
    return torch.tensor(v, dtype=torch.int32)


@pytest.mark.parametrize(
    "over, field, rule",
    [
        (dict(cu_seqlens_q=torch.tensor([0, 3, 7, 7])), "cu_seqlens_q", "dtype must be torch.int32"),
        (dict(cu_seqlens_kv=i32(0, 3, 7, 7).view(2, 2)), "cu_seqlens_kv", "must be 1-D"),
        (dict(cu_seqlens_q=i32(1, 3, 7, 7)), "cu_seqlens_q", "must start at 0"),
        (dict(cu_seqlens_kv=i32(0, 5, 3, 7)), "cu_seqlens_kv", "offsets must be non-decreasing"),
        (
            dict(cu_seqlens_q=i32(0, 3, 7, 9), cu_seqlens_kv=i32(0, 3, 7, 9), max_seqlen_q=9, max_seqlen_kv=9),
            "cu_seqlens_q",
            "last offset exceeds total_tokens",
        ),
        (dict(max_seqlen_q=3), "max_seqlen_q", "below a real sequence length"),
        (dict(max_seqlen_kv=2), "max_seqlen_kv", "below a real sequence length"),
        (dict(cu_seqlens_q_padded=i32(0, 4, 6, 8)), "cu_seqlens_q_padded", "padded length below unpadded length"),
        (dict(cu_seqlens_kv=i32(0, 3, 7)), "cu_seqlens_kv", "q/kv capacity mismatch"),
        (dict(cu_seqlens_q_padded=i32(0, 4, 8)), "cu_seqlens_q_padded", "q/kv capacity mismatch"),
        (dict(qkv_format="sbhd"), "qkv_format", "unknown format"),
        (dict(qkv_format="xyz"), "qkv_format", "unknown format"),
        (dict(cu_seqlens_kv=None), "cu_seqlens_kv", "required for qkv_format='thd'"),
        (dict(max_seqlen_q=None), "max_seqlen_q", "required (a static Python int)"),
        (dict(max_seqlen_q=torch.tensor(4)), "max_seqlen_q", "must be a Python int (static)"),
        (dict(cu_seqlens_kv=i32(0, 3, 7, 7).to("meta")), "cu_seqlens_kv", "all tensors must be on one device"),
        (dict(seq_idx=torch.zeros(1, 5, dtype=torch.int32)), "seq_idx", "must be int32 [1, 8]"),
    ],
)
def test_validate_names_field_and_rule(over, field, rule):
    with pytest.raises(PackedSeqParamsError) as e:
        raw(**over).validate()
    assert (e.value.field, e.value.rule) == (field, rule)
    assert isinstance(e.value, ValueError)


def test_validate_capacity_respected():
    raw().validate(capacity=3)
    with pytest.raises(PackedSeqParamsError) as e:
        raw().validate(capacity=8)
    assert e.value.rule == "capacity not respected"


def test_validate_uses_host_offsets_without_reading_tensors():
    p = PackedSeqParams.from_seqlens([3, 4], capacity=4)
    # Host offsets describe the batch; a corrupted tensor is not read (no sync), the host values are.
    bad_host = dict(p.host_offsets, cu_seqlens_q=(0, 5, 4, 4, 4))
    with pytest.raises(PackedSeqParamsError) as e:
        p.replace(host_offsets=bad_host).validate()
    assert e.value.rule == "offsets must be non-decreasing"


def test_replace_of_dynamic_field_drops_stale_host_offsets():
    p = PackedSeqParams.from_seqlens([3, 4], capacity=4)
    q = p.replace(cu_seqlens_q=i32(0, 1, 2, 7, 7), cu_seqlens_kv=i32(0, 1, 2, 7, 7))
    assert q.host_offsets is None
    with pytest.raises(PackedSeqParamsError, match="below a real sequence length"):
        q.validate()


def test_validate_device_only_params_checks_structure_only_unless_sync():
    meta = raw().to("meta")
    meta.validate()  # structure only: values live on the device and reading them would sync
    with pytest.raises(NotImplementedError):
        meta.validate(sync=True)  # the one device-to-host read is attempted (meta tensors have no data)


def test_signature_covers_every_static_field():
    p = PackedSeqParams.from_seqlens([3, 4], capacity=4, total_tokens=16)
    sig = p.static_signature()
    hash(sig)
    changed = {
        "qkv_format": p.replace(qkv_format="bshd"),
        "max_seqlen_q": p.replace(max_seqlen_q=8),
        "max_seqlen_kv": p.replace(max_seqlen_kv=8),
        "local_cp_size": p.replace(local_cp_size=2),
        "cp_group": p.replace(cp_group=object()),
        "total_tokens": p.replace(total_tokens=32),
        "cu_seqlens_q": p.replace(cu_seqlens_q=i32(0, 3, 7, 7, 7, 7)),
        "cu_seqlens_kv": p.replace(cu_seqlens_kv=torch.tensor([0, 3, 7, 7, 7])),
        "cu_seqlens_q_padded": p.replace(cu_seqlens_q_padded=i32(0, 4, 8, 8, 8)),
        "seq_idx": p.with_seq_idx(),
    }
    for field, other in changed.items():
        diff = sig.diff(other.static_signature())
        assert [d[0] for d in diff] == [field], (field, diff)
        assert sig != other.static_signature()
    # Dynamic values are not static: another packing with the same shapes has the same signature.
    assert PackedSeqParams.from_seqlens([1, 1, 4], capacity=4, total_tokens=16, max_seqlen=4).static_signature() == sig


def test_cp_group_compared_by_identity():
    g1, g2 = object(), object()
    p = PackedSeqParams.from_seqlens([3])
    a, b, c = p.replace(cp_group=g1), p.replace(cp_group=g1), p.replace(cp_group=g2)
    assert a.static_signature() == b.static_signature() != c.static_signature()


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


def test_assert_valid_async_accepts_valid_params_on_cpu():
    p = PackedSeqParams.from_seqlens([3, 0, 4], capacity=5, pad_to_multiple=4, total_tokens=16)
    p.assert_valid_async()
    with pytest.raises(RuntimeError):
        raw(max_seqlen_q=3).assert_valid_async()


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
