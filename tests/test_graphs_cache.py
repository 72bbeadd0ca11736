"""The capture cache (packgraph.graphs.cache): LRU policy, logs, mismatch errors, output registry. CPU."""

import logging
import math
import random

import pytest
import torch

from packgraph.graphs.cache import FlightStack, GraphCache, GraphSignatureError, OutputRegistry
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


class _Flight:
    """A stand-in entry: capture numbers, a pool and whether its forward is still waiting for its backward."""

    def __init__(self, fwd, freed=math.inf, pool=None):
        self.fwd_seq, self.freed, self.pool, self.in_flight = fwd, freed, pool, True

    def activations_freed_at(self):
        return self.freed


def _naive_hazard(entries, entry, seq):
    return next(
        (
            o
            for o in entries
            if o is not entry
            and o.in_flight
            and o.pool is entry.pool
            and (o.fwd_seq > seq or o.activations_freed_at() < seq)
        ),
        None,
    )


def test_flight_stack_matches_a_naive_scan():
    rng = random.Random(0)
    for _ in range(300):
        stack, live = FlightStack(), []
        for _ in range(rng.randint(1, 12)):
            e = _Flight(rng.randint(1, 40), rng.choice([math.inf, rng.randint(1, 40)]), rng.choice([None, "p"]))
            if rng.random() < 0.3 and live:
                gone = rng.choice(live)
                stack.pop(gone)  # a backward ran (usually the top; any entry works)
                live.remove(gone)
            stack.push(e)
            live.append(e)
            if rng.random() < 0.2:
                e.in_flight = False  # its autograd graph was dropped
        probe = _Flight(rng.randint(1, 40), pool=rng.choice([None, "p"]))
        seq = rng.randint(1, 40)
        assert stack.hazard(probe, seq) is _naive_hazard(live, probe, seq)
        assert {id(e) for e in stack.entries()} <= {id(e) for e in live}


def test_flight_stack_answers_a_model_order_from_the_top():
    # A 4-layer stack captured in run order: forwards 1..4, backwards 5..8 in reverse (layer 3 first).
    layers = [_Flight(k + 1, freed=8 - k) for k in range(4)]
    stack = FlightStack()
    for layer in layers:
        assert stack.hazard(layer, layer.fwd_seq) is None
        stack.push(layer)
    for layer in reversed(layers):
        stack.pop(layer)
        assert stack.hazard(layer, layer.freed) is None
    assert len(stack) == 0
    later = _Flight(9)  # another signature, captured after the first set freed its activations
    stack.push(layers[0])
    assert stack.hazard(later, later.fwd_seq) is layers[0]
