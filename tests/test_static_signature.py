"""StaticSignature: it covers every static field, and compares process groups by identity."""

import torch

from packgraph import PackedSeqParams


def i32(*v):
    return torch.tensor(v, dtype=torch.int32)


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
