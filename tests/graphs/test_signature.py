"""Signature extraction, diffs and params preparation (packgraph.graphs.signature): pure Python, CPU."""

from collections import namedtuple

import pytest
import torch

from packgraph.buckets import BucketPolicy, default_buckets
from packgraph.graphs.signature import (
    CallSignature,
    ParamsPreparer,
    TensorKey,
    dyn_keys,
    flatten_call,
    rebuild_call,
    signature_diff,
)
from packgraph.params import PackedSeqParams, PackedSeqParamsError

Pair = namedtuple("Pair", "a b")


def _sig(args, kwargs=None, *, prepare=None, training=True, autocast=None):
    prepare = prepare or ParamsPreparer()
    a, k, dyn = flatten_call(tuple(args), kwargs or {}, prepare)
    return CallSignature(a, k, training, autocast), dyn


def test_dynamic_inputs_in_order_and_statics_in_key():
    x = torch.randn(4, 3)
    y = torch.randn(2, dtype=torch.float64, requires_grad=True)
    z = torch.zeros(5, dtype=torch.int64)
    p = PackedSeqParams.from_seqlens([3, 1], capacity=4, total_tokens=4, max_seqlen=4)
    args = (x, [y, 7, {"z": z, "s": "relu"}], p, None)
    sig, dyn = _sig(args, {"scale": 0.5, "extra": Pair(z, 2)})
    # args in order, then kwargs sorted by name ("extra" < "scale"), each depth-first in pytree order
    assert [d if isinstance(d, torch.Tensor) else d.params for d in dyn][:3] == [x, y, z]
    assert dyn[3].params.cu_seqlens_q is p.cu_seqlens_q and dyn[4] is z and len(dyn) == 5
    keys = dyn_keys(sig)
    assert [k.shape if isinstance(k, TensorKey) else "params" for k in keys] == [
        torch.Size([4, 3]),
        torch.Size([2]),
        torch.Size([5]),
        "params",
        torch.Size([5]),
    ]
    assert keys[1].dtype == torch.float64 and keys[1].requires_grad is True and keys[0].requires_grad is False
    assert type(keys[0]) is TensorKey and keys[0].source is None  # copied in, not read from another graph
    # the same call with other tensor values has the same signature; a static value change does not
    x2, y2, z2 = torch.randn(4, 3), torch.randn(2, dtype=torch.float64, requires_grad=True), torch.ones(5).long()
    p2 = PackedSeqParams.from_seqlens([2, 2], capacity=4, total_tokens=4, max_seqlen=4)
    same, _ = _sig((x2, [y2, 7, {"z": z2, "s": "relu"}], p2, None), {"scale": 0.5, "extra": Pair(z2, 2)})
    assert same == sig and hash(same) == hash(sig)
    other, _ = _sig((x2, [y2, 7, {"z": z2, "s": "gelu"}], p2, None), {"scale": 0.5, "extra": Pair(z2, 2)})
    assert other != sig


def test_types_of_equal_statics_are_distinguished_and_unhashables_by_identity():
    x = torch.randn(2)
    a, _ = _sig((x, 1))
    b, _ = _sig((x, True))
    c, _ = _sig((x, 1.0))
    assert len({a, b, c}) == 3
    s = {1, 2}  # unhashable, not a pytree container: compared by identity
    d1, _ = _sig((x, s))
    d2, _ = _sig((x, s))
    d3, _ = _sig((x, {1, 2}))
    assert d1 == d2 and d1 != d3


def test_rebuild_call_round_trip():
    x, y = torch.randn(3), torch.randn(2)
    p = PackedSeqParams.from_seqlens([2], capacity=2, total_tokens=3)
    args, kwargs = (x, (y, 5), p), {"w": {"k": x}, "flag": False}
    _, _, dyn = flatten_call(args, kwargs, ParamsPreparer())
    subs = [f"S{i}" for i in range(len(dyn))]
    new_args, new_kwargs = rebuild_call(args, kwargs, subs)
    assert new_args == ("S0", ("S1", 5), "S2")
    assert new_kwargs == {"flag": False, "w": {"k": "S3"}}
    with pytest.raises(ValueError, match="more substitutes"):
        rebuild_call(args, kwargs, [*subs, "extra"])


def test_signature_diff_names_every_field():
    p = PackedSeqParams.from_seqlens([3, 2], capacity=4, total_tokens=8, max_seqlen=4)
    q = PackedSeqParams.from_seqlens([3, 2, 1], capacity=8, total_tokens=10, max_seqlen=8)
    x = torch.randn(8, 4, requires_grad=True)
    captured, _ = _sig((x, p), {"causal": True}, prepare=ParamsPreparer(keep_mamba_fields=True))
    given, _ = _sig(
        (torch.randn(10, 4, dtype=torch.float64), q),
        {"causal": False, "window": 3},
        prepare=ParamsPreparer(keep_mamba_fields=True),
        training=False,
        autocast=torch.bfloat16,
    )
    diffs = {field: (a, b) for field, a, b in signature_diff(captured, given)}
    assert diffs["args[0].shape"] == ((8, 4), (10, 4))
    assert diffs["args[0].dtype"] == (torch.float32, torch.float64)
    assert diffs["args[0].requires_grad"] == (True, False)
    assert diffs["args[1].max_seqlen_q"] == (4, 8) and diffs["args[1].max_seqlen_kv"] == (4, 8)
    assert diffs["args[1].total_tokens"] == (8, 10)
    assert "args[1].cu_seqlens_q" in diffs and "args[1].cu_seqlens_kv" in diffs  # capacity 4 -> 8
    assert diffs["kwargs['causal']"][0] != diffs["kwargs['causal']"][1]
    assert diffs["kwargs['window']"][0] == "<absent>"
    assert diffs["module.training"] == (True, False)
    assert diffs["autocast"] == ("off", torch.bfloat16)
    assert len(diffs) == 12
    assert signature_diff(captured, captured) == []


def test_shared_tensor_pattern_is_part_of_the_signature():
    p = PackedSeqParams.from_seqlens([3, 2], capacity=4, total_tokens=8)
    assert p.cu_seqlens_kv is p.cu_seqlens_q
    split = p.replace(cu_seqlens_kv=p.cu_seqlens_q.clone())
    a, dyn_a = _sig((p,))
    b, dyn_b = _sig((split,))
    assert len(dyn_a[0].tensors) == 1 and len(dyn_b[0].tensors) == 2
    assert a != b
    assert [f for f, _, _ in signature_diff(a, b)] == ["args[0].shared tensors"]


def test_preparer_caches_per_object_and_notices_changes():
    prep = ParamsPreparer()
    p = PackedSeqParams.from_seqlens([3, 2], capacity=4, total_tokens=8)
    first = prep(p)
    assert prep(p) is first  # same object, nothing changed: no re-validation, no re-bucketing
    p.max_seqlen_q = 5  # field reassigned
    second = prep(p)
    assert second is not first and second.params.max_seqlen_q == 5
    p.cu_seqlens_q.add_(0)  # in-place write bumps the version counter
    assert prep(p) is not second
    other = PackedSeqParams.from_seqlens([3, 2], capacity=4, total_tokens=8)
    assert prep(other) is not prep(p)


def test_preparer_notices_a_cpu_write_that_keeps_the_version():
    """A write through ``.numpy()`` or ``.data`` keeps the version counter. On the CPU the cached preparation
    (its validation and bucket) is not reused after one: the params are validated again, and their host offsets
    no longer agree with the tensor."""
    policy = default_buckets(64)
    for write in ("numpy", "data"):
        prep = ParamsPreparer(buckets=policy)
        p = PackedSeqParams.from_seqlens([5, 5, 5, 5, 5, 20], capacity=8, total_tokens=64)
        first = prep(p)
        assert prep(p) is first
        fresh = torch.tensor([0, 20, 20, 20, 20, 20, 20, 20, 20], dtype=torch.int32)
        if write == "numpy":
            p.cu_seqlens_q.numpy()[:] = fresh.numpy()
        else:
            p.cu_seqlens_q.data.copy_(fresh)
        with pytest.raises(PackedSeqParamsError, match="disagree"):
            prep(p)


def test_preparer_drops_mamba_fields_unless_kept():
    p = PackedSeqParams.from_seqlens([3, 2], capacity=4, total_tokens=8).with_seq_idx()
    q = PackedSeqParams.from_seqlens([3, 2], capacity=4, total_tokens=9).with_seq_idx()
    a, b = ParamsPreparer()(p), ParamsPreparer()(q)
    assert a.params.total_tokens is None and a.params.seq_idx is None
    assert a.key == b.key  # total_tokens and seq_idx differ, the attention signature does not
    ka, kb = ParamsPreparer(keep_mamba_fields=True)(p), ParamsPreparer(keep_mamba_fields=True)(q)
    assert ka.key != kb.key and ka.params.seq_idx is not None


def test_preparer_validation_modes(monkeypatch):
    bad = PackedSeqParams.from_seqlens([3, 2], capacity=4, total_tokens=8).replace(max_seqlen_q=2)
    bad = bad.replace(host_offsets={"cu_seqlens_q": (0, 3, 5, 5, 5), "cu_seqlens_kv": (0, 3, 5, 5, 5)})
    with pytest.raises(PackedSeqParamsError, match="max_seqlen_q"):
        ParamsPreparer(validate="host")(bad)
    ParamsPreparer(validate="off")(bad)  # no checks at all
    good = PackedSeqParams.from_seqlens([3, 2], capacity=4, total_tokens=8)
    seen = []
    original = PackedSeqParams.validate

    def spy(self, *, sync=False, capacity=None):
        seen.append(sync)
        return original(self, sync=sync, capacity=capacity)

    monkeypatch.setattr(PackedSeqParams, "validate", spy)
    ParamsPreparer(validate="sync")(good)
    ParamsPreparer(validate="debug")(good)
    ParamsPreparer(validate="host")(good)
    assert seen == [True, False, False]
    with pytest.raises(ValueError, match="validate must be one of"):
        ParamsPreparer(validate="always")


def test_preparer_maps_onto_buckets():
    policy = BucketPolicy((4, 8, 16), (4, 8))
    prep = ParamsPreparer(buckets=policy)
    p = PackedSeqParams.from_seqlens([3, 5], total_tokens=16)  # true capacity 2, true max 5
    q = PackedSeqParams.from_seqlens([1, 2, 6, 1, 1], total_tokens=16)  # capacity 5, max 6
    a, b = prep(p), prep(q)
    assert a.params.max_seqlen_q == 8 and a.params.capacity == 4
    assert b.params.max_seqlen_q == 8 and b.params.capacity == 8
    assert a.params.cu_seqlens_q.tolist() == [0, 3, 8, 8, 8]  # ghost slots repeat the last offset
    r = PackedSeqParams.from_seqlens([2, 7, 1], total_tokens=16)  # capacity 3 -> 4, max 7 -> 8: same bucket as p
    assert prep(r).key == a.key
    with pytest.raises(ValueError, match="no bucket fits"):
        prep(PackedSeqParams.from_seqlens([17], total_tokens=17))


def test_container_structure_and_leaves_are_diffed():
    x = torch.zeros(2)
    a, _ = _sig(({"k": x, "n": 1},))
    b, _ = _sig(({"k": x, "m": 1},))
    c, _ = _sig(({"k": x.double(), "n": 2},))
    assert [f for f, _, _ in signature_diff(a, b)] == ["args[0].structure"]
    assert [f for f, _, _ in signature_diff(a, c)] == ["args[0].leaf[0].dtype", "args[0].leaf[1]"]
    assert signature_diff(a, c)[1][1:] == ("int 1", "int 2")


def test_preparer_buckets_by_its_policys_short_docs_switch():
    """The bucket of params with ghost slots depends on the switch (``BucketPolicy.apply`` keeps them from the
    switch on): each preparer buckets by its own policy's, and the prepared params carry it."""
    import dataclasses

    from packgraph.buckets import default_buckets

    params = PackedSeqParams.from_seqlens([3] * 200, capacity=1000, total_tokens=1024)
    for m, capacity in ((129, 512), (513, 1024), (None, 512)):
        prepare = ParamsPreparer(buckets=dataclasses.replace(default_buckets(1024), short_docs_min_slots=m))
        prepared = prepare(params).params
        assert (prepared.capacity, prepared.short_docs_min_slots) == (capacity, m)
