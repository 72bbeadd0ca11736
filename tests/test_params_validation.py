"""PackedSeqParams.validate and assert_valid_async: every rule, named by field and rule."""

import pytest
import torch

from packgraph import PackedSeqParams, PackedSeqParamsError


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
    # Off the CPU, host offsets describe the batch; the tensor is not read (that would sync), the host values are.
    bad_host = dict(p.host_offsets, cu_seqlens_q=(0, 5, 4, 4, 4))
    with pytest.raises(PackedSeqParamsError) as e:
        p.to("meta").replace(host_offsets=bad_host).validate()
    assert e.value.rule == "offsets must be non-decreasing"
    # On the CPU comparing them with the tensor is free: copies that disagree with it are refused as such.
    with pytest.raises(PackedSeqParamsError) as e:
        p.replace(host_offsets=bad_host).validate()
    assert (e.value.field, e.value.rule) == ("cu_seqlens_q", "host_offsets disagree with the tensor")


def test_validate_device_only_params_checks_structure_only_unless_sync():
    meta = raw().to("meta")
    meta.validate()  # structure only: values live on the device and reading them would sync
    with pytest.raises(NotImplementedError):
        meta.validate(sync=True)  # the one device-to-host read is attempted (meta tensors have no data)


def test_assert_valid_async_accepts_valid_params_on_cpu():
    p = PackedSeqParams.from_seqlens([3, 0, 4], capacity=5, pad_to_multiple=4, total_tokens=16)
    p.assert_valid_async()
    with pytest.raises(RuntimeError):
        raw(max_seqlen_q=3).assert_valid_async()
