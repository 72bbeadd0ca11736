"""The capture cache (packgraph.graphs.cache): LRU policy, logs, mismatch errors, output registry. CPU."""

import logging

import pytest
import torch

from packgraph.graphs.cache import GraphCache, GraphSignatureError, OutputRegistry
from packgraph.graphs.signature import CallSignature, ParamsPreparer, flatten_call
from packgraph.params import PackedSeqParams, PackedSeqParamsError


def _key(n: int, *, max_seqlen: int = 4, training: bool = True) -> CallSignature:
    x = torch.zeros(n, 2)
    p = PackedSeqParams.from_seqlens([1], capacity=2, total_tokens=n, max_seqlen=max_seqlen)
    a, k, _ = flatten_call((x, p), {}, ParamsPreparer())
    return CallSignature(a, k, training, None)


def test_lru_order_bound_and_logs(caplog):
    cache = GraphCache(max_graphs=2, name="blk")
    k1, k2, k3 = _key(4), _key(5), _key(6)
    with caplog.at_level(logging.INFO, logger="packgraph.graphs"):
        assert cache.insert(k1, "g1") == []
        assert cache.insert(k2, "g2") == []
        assert cache.get(k1) == "g1"  # k1 is now the most recently used: k2 goes first
        evicted = cache.insert(k3, "g3")
    assert evicted == ["g2"]
    assert list(cache) == [k1, k3] and len(cache) == 2
    assert cache.get(k2) is None and cache.captures == 3 and cache.evictions == 1
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    warns = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(infos) == 3 and len(warns) == 1
    assert "first capture" in infos[0].getMessage()
    assert "args[0].shape (4, 2) -> (5, 2)" in infos[1].getMessage()  # the log says why it recaptured
    assert "max_graphs=2" in warns[0].getMessage() and "BucketPolicy" in warns[0].getMessage()
    assert cache.clear() == ["g1", "g3"] and len(cache) == 0


def test_error_mode_names_every_differing_field():
    cache = GraphCache(on_mismatch="error", name="attn")
    captured = _key(8, max_seqlen=4)
    cache.check_new(captured)  # nothing captured yet: allowed
    cache.insert(captured, "g")
    given = _key(9, max_seqlen=8, training=False)
    with pytest.raises(GraphSignatureError) as info:
        cache.check_new(given)
    err = info.value
    assert isinstance(err, PackedSeqParamsError) and isinstance(err, ValueError)
    fields = [d[0] for d in err.diffs]
    assert fields == [
        "args[0].shape",
        "args[1].max_seqlen_q",
        "args[1].max_seqlen_kv",
        "module.training",
    ]
    msg = str(err)
    assert "attn" in msg and "4 fields differ" in msg
    assert "args[0].shape: captured (8, 2), given (9, 2)" in msg
    assert "args[1].max_seqlen_q: captured 4, given 8" in msg
    assert "module.training: captured True, given False" in msg
    assert err.field == ", ".join(fields)


def test_cache_arguments_are_checked():
    with pytest.raises(ValueError, match="on_mismatch"):
        GraphCache(on_mismatch="ignore")
    with pytest.raises(ValueError, match="max_graphs"):
        GraphCache(max_graphs=0)


def test_output_registry_tokens():
    reg = OutputRegistry()
    out = torch.zeros(4, 3)
    token = reg.register(out, owner=1)
    assert reg.lookup(out.detach(), owner=2) == token  # same memory: another graph may read it in place
    assert reg.lookup(out, owner=1) is None  # a graph never reads its own output in place
    assert reg.lookup(out[1:], owner=2) is None  # other start address
    assert reg.lookup(out.clone(), owner=2) is None
    reg.unregister(out, token + 1)  # a stale token does not remove a newer registration
    assert reg.lookup(out, owner=2) == token
    reg.unregister(out, token)
    assert reg.lookup(out, owner=2) is None and len(reg) == 0
