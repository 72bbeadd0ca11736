"""Backward results released to the pool once idle (``packgraph.graphs.memory``), checked against eager.

Each signature (here: a capacity) writes parameter grads of its own, and a new signature's forward capture releases
the grads nobody holds. The stand-in recorder writes NaNs over released memory at every later warm-up, capture and
replay of a graph captured after the release (what the CUDA pool may do), so a grad left on released memory while
something could overwrite it shows up as NaN here.
"""

import gc

import pytest
import torch

from packgraph.graphs import GraphOrderError, memory
from packgraph.graphs.capture import capture_layers_with, capture_with
from tests.eager_recorder import EagerRecorder
from tests.graphs.test_autograd_exact import _block, _grads, _loss, _params, _same_grads, _x

LENGTHS = [10, 20, 5]
SIGS = {name: _params(LENGTHS, capacity=c) for name, c in (("A", 4), ("B", 8), ("C", 16))}


def _entries(graphed):
    return list(graphed.cache.values())


def _param_records(entry):
    """``[(parameter, the record of its grad)]`` of an entry's backward results."""
    n_in = len(entry.grad_positions)
    pairs = zip(entry.trainable, entry.bwd.grad_records[n_in:], strict=True)
    return [(p, r) for p, r in pairs if r is not None]


def test_idle_grads_are_released_at_the_next_new_signature_and_held_ones_are_not():
    block = _block()
    graphed = capture_with(EagerRecorder(), block, (_x(0), SIGS["A"]))
    recorder = graphed.group.recorder
    _loss(graphed(_x(1), SIGS["A"])).backward()
    held = block.attn.qkv.weight.grad
    _loss(graphed(_x(2), SIGS["B"])).backward()  # B captured now; every p.grad still holds A's grads
    a, b = _entries(graphed)
    a_params = _param_records(a)
    assert a_params and not any(r.released_at is not None for _, r in a_params)
    block.zero_grad(set_to_none=True)
    assert held.data_ptr() != 0  # the caller's tensor survives zero_grad, and keeps its memory
    _loss(graphed(_x(3), SIGS["C"])).backward()  # C captured: B's grads are idle, A's qkv grad is not
    qkv = [r for p, r in a_params if p is block.attn.qkv.weight]
    assert len(qkv) == 1 and qkv[0].released_at is None
    assert all(r.released_at is not None for r in b.bwd.grad_records if r is not None)
    del held
    block.zero_grad(set_to_none=True)
    _loss(graphed(_x(4), SIGS["A"]).sum()).backward()  # a replay: no capture, nothing released
    assert qkv[0].released_at is None
    block.zero_grad(set_to_none=True)
    _loss(graphed(_x(5), _params(LENGTHS, capacity=32))).backward()  # a fourth signature: now A's are idle
    assert all(r.released_at is not None for e in (a, b) for r in e.bwd.grad_records if r is not None)
    assert recorder.released and recorder.poisonings > 0


def _schedule_grads(fn, block, schedule, set_to_none):
    """Per step, the grads after its micro-batches (``schedule``: one string of signature names per step)."""
    out = []
    block.zero_grad(set_to_none=True)
    for step, names in enumerate(schedule):
        block.zero_grad(set_to_none=set_to_none)
        for mb, name in enumerate(names):
            _loss(fn(_x(10 * step + mb), SIGS[name])).backward()
        out.append(_grads(block))
    return out


def test_micro_batches_across_signatures_match_eager():
    """Grads accumulate over micro-batches whose signatures differ, some captured in the middle of the step (the
    first micro-batch's grads are then held while the new capture may allocate their memory)."""
    schedule = ["AA", "AB", "BC", "CA", "B", "CB", "AAC"]
    for set_to_none in (True, False):
        block = _block()
        graphed = capture_with(EagerRecorder(), block, (_x(0), SIGS["A"]))
        got = _schedule_grads(graphed, block, schedule, set_to_none)
        want = _schedule_grads(block, block, schedule, set_to_none)
        for g, w in zip(got, want, strict=True):
            _same_grads(g, w)
        assert graphed.group.recorder.released


def test_grads_kept_across_steps_and_signatures_keep_their_values():
    block = _block()
    graphed = capture_with(EagerRecorder(), block, (_x(0), SIGS["A"]))
    order = "ABACBCA"
    history = []
    for i, name in enumerate(order):
        block.zero_grad(set_to_none=True)
        _loss(graphed(_x(i), SIGS[name])).backward()
        history.append(block.mlp.down.weight.grad)  # no clone: eager keeps each step's tensor as it was
    assert graphed.group.recorder.released
    for i, name in enumerate(order):
        block.zero_grad(set_to_none=True)
        _loss(block(_x(i), SIGS[name])).backward()
        torch.testing.assert_close(history[i], block.mlp.down.weight.grad)


def test_autograd_grad_results_survive_later_captures_and_replays():
    block = _block()
    params = list(block.parameters())
    graphed = capture_with(EagerRecorder(), block, (_x(0), SIGS["A"]))
    kept = torch.autograd.grad(_loss(graphed(_x(1), SIGS["A"])), params)
    for i, name in enumerate("BCAB"):
        block.zero_grad(set_to_none=True)
        _loss(graphed(_x(2 + i), SIGS[name])).backward()
    want = torch.autograd.grad(_loss(block(_x(1), SIGS["A"])), params)
    for g, w in zip(kept, want, strict=True):
        torch.testing.assert_close(g, w)


def _drop_graphs_holding_released_grads(collect) -> None:
    """Train over signatures A, B, A (A's grads were released when B was captured, and p.grad is on them), drop the
    graphed callable, ``collect()`` the garbage, then let everything released be reused: the grads must not move."""
    block = _block()
    graphed = capture_with(EagerRecorder(), block, (_x(0), SIGS["A"]))
    recorder = graphed.group.recorder
    for i, name in enumerate("ABA"):
        block.zero_grad(set_to_none=True)
        _loss(graphed(_x(i if i < 2 else 5), SIGS[name])).backward()
    got = _grads(block)
    del graphed
    collect()
    for _, pool, _ in recorder.released:
        recorder.reuse_released(pool)  # everything released is now somebody else's memory
    _same_grads(_grads(block), got)


def test_grads_held_when_the_graphs_go_away_keep_their_values():
    """Released memory is safe only while the pool lives: a grad still on it when the graphed callable is dropped is
    moved to memory of its own first."""
    _drop_graphs_holding_released_grads(gc.collect)


def test_grads_held_when_the_graphs_go_away_inside_a_dispatch_mode_keep_their_values():
    """The garbage collector may drop the graphs while torch.compile traces under FakeTensorMode: the grads left
    on released memory are still moved to real memory of their own (the mode does not intercept the copies)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def collect_under_fake_mode():
        with FakeTensorMode():
            gc.collect()

    _drop_graphs_holding_released_grads(collect_under_fake_mode)


def test_hidden_state_grads_kept_by_hooks_survive_the_shared_chained_buffers():
    """Every chained layer writes its input grad into one of two buffers, which the backward two layers down
    overwrites: a grad a hook keeps (or ``retain_grad``) must be moved off it first, as eager's stays as it was."""
    from packgraph.buckets import default_buckets
    from packgraph.graphs.capture import capture_layers_with
    from tests.graphs.test_autograd_exact import T

    layers = [_block(seed) for seed in range(4)]
    graphed = capture_layers_with(EagerRecorder(), layers, (_x(0), SIGS["A"]), buckets=default_buckets(T))
    got = []
    for stack in (layers, graphed):
        kept = []
        for step, name in enumerate("ABA"):
            for layer in layers:
                layer.zero_grad(set_to_none=True)
            h = _x(step)
            for k, layer in enumerate(stack):
                h = layer(h, SIGS[name])
                if k < len(layers) - 1:
                    h.register_hook(kept.append)
            _loss(h).backward()
        got.append(kept)
    assert len(got[0]) == len(got[1]) == 9
    for g, w in zip(got[1], got[0], strict=True):
        torch.testing.assert_close(g, w)
    assert graphed[1].cache.get(next(iter(graphed[1].cache))).bwd.chain_records  # they did use the shared buffer


def _eager_grad(block, seed, name):
    block.zero_grad(set_to_none=True)
    _loss(block(_x(seed), SIGS[name])).backward()
    return block.mlp.down.weight.grad.clone()


def test_a_held_released_grad_survives_evictions_and_rebinds():
    """A grad handed out on released memory stays the caller's through every way the engine drops graphs or reuses
    the pool: a capture, an LRU eviction of its signature, and new parameters (``_rebind``)."""
    block = _block()
    graphed = capture_with(EagerRecorder(), block, (_x(0), SIGS["A"]), max_graphs=2)
    recorder = graphed.group.recorder
    down = block.mlp.down.weight
    order, held = "ABACB", []
    for i, name in enumerate(order):
        block.zero_grad(set_to_none=True)
        _loss(graphed(_x(i), SIGS[name])).backward()
        if i == 2:  # A's grads were released at B's capture: this one is a view of released memory
            records = [r for e in graphed.cache.values() for p, r in _param_records(e) if p is down]
            record = next(r for r in records if r.static.data_ptr() == down.grad.data_ptr())
            assert record.released_at is not None
        if i >= 2:  # (holding the first two would keep A's and B's grads from being released at all)
            held.append(down.grad)  # C's capture, then B's recapture after A's eviction, may reuse it
    assert graphed.evictions >= 1
    with torch.no_grad():
        block.mlp.down.weight = torch.nn.Parameter(down.detach().clone())  # new parameters: every graph dropped
    block.zero_grad(set_to_none=True)
    _loss(graphed(_x(9), SIGS["C"])).backward()
    held.append(block.mlp.down.weight.grad)
    for _, pool, _ in recorder.released:
        recorder.reuse_released(pool)  # everything released is somebody else's memory now
    want = [_eager_grad(block, i, name) for i, name in enumerate(order)][2:] + [_eager_grad(block, 9, "C")]
    for i, (g, w) in enumerate(zip(held, want, strict=True)):
        torch.testing.assert_close(g, w, msg=f"step {i}")


def test_a_grad_on_released_memory_survives_new_parameters():
    block = _block()
    graphed = capture_with(EagerRecorder(), block, (_x(0), SIGS["A"]))
    recorder = graphed.group.recorder
    for i, name in enumerate("ABA"):
        block.zero_grad(set_to_none=True)
        _loss(graphed(_x(i), SIGS[name])).backward()
    held = block.mlp.down.weight.grad  # A's, handed out on the memory B's capture released
    assert held.untyped_storage().data_ptr() in {s.data_ptr() for s, _, _ in recorder.released}
    with torch.no_grad():
        block.mlp.down.weight = torch.nn.Parameter(block.mlp.down.weight.detach().clone())
    block.zero_grad(set_to_none=True)
    _loss(graphed(_x(3), SIGS["C"])).backward()  # every graph dropped; C captured into the same pool
    for _, pool, _ in recorder.released:
        recorder.reuse_released(pool)
    torch.testing.assert_close(held, _eager_grad(block, 2, "A"))


def test_nothing_is_released_in_a_pool_the_caller_shares():
    """A pool passed to capture() may also serve other capture groups, whose captures could reuse memory this one
    hands out: its grads stay allocated, and still match eager."""
    recorder = EagerRecorder()
    recorder.shares_pool = True  # what CudaRecorder sets when capture() is given a pool
    block = _block()
    graphed = capture_with(recorder, block, (_x(0), SIGS["A"]))
    got = _schedule_grads(graphed, block, ["A", "B", "C", "AB"], set_to_none=True)
    want = _schedule_grads(block, block, ["A", "B", "C", "AB"], set_to_none=True)
    for g, w in zip(got, want, strict=True):
        _same_grads(g, w)
    assert not recorder.released
    assert all(r.released_at is None for e in graphed.cache.values() for r in e.bwd.grad_records if r is not None)


def test_layers_of_different_signatures_in_one_stack_pass_grads_through_the_chained_buffers():
    """Freezing one layer mid-run gives it signatures of its own while its neighbours keep theirs: the grads that
    cross between them still equal eager's, hidden-state grads kept by hooks included."""
    from packgraph.buckets import default_buckets
    from packgraph.graphs.capture import capture_layers_with
    from tests.graphs.test_autograd_exact import T

    layers = [_block(seed) for seed in range(4)]
    graphed = capture_layers_with(EagerRecorder(), layers, (_x(0), SIGS["A"]), buckets=default_buckets(T))

    def run(stack, step, name):
        kept = []
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        x = _x(step)
        h = x
        for k, layer in enumerate(stack):
            h = layer(h, SIGS[name])
            if k < len(layers) - 1:
                h.register_hook(kept.append)
        _loss(h).backward()
        return [x.grad.clone(), *kept, *(_grads(layer) for layer in layers)]

    for step, (name, frozen) in enumerate([("A", False), ("B", False), ("A", True), ("B", True), ("A", False)]):
        for p in layers[2].parameters():
            p.requires_grad_(not frozen)
        got, want = run(graphed, step, name), run(layers, step, name)
        for g, w in zip(got, want, strict=True):
            if isinstance(w, dict):
                _same_grads(g, w)
            else:
                torch.testing.assert_close(g, w)
    assert [g.num_graphs for g in graphed] == [1, 1, 2, 1]  # A and B share a bucket; layer 2 frozen and not


def test_a_random_schedule_of_steps_on_a_chained_stack_matches_eager():
    """Released grads, chained buffers and the book, together: random packings over three buckets, one or two
    micro-batches per step, ``zero_grad`` with and without ``set_to_none``, hooks that keep hidden-state grads, and
    no-grad scoring calls (captured forward-only) in between. Every grad, every kept tensor and every score is
    compared with eager's, step by step."""
    import random

    from packgraph.buckets import default_buckets
    from packgraph.graphs.capture import capture_layers_with
    from packgraph.params import PackedSeqParams
    from tests.graphs.test_autograd_exact import T

    rng = random.Random(7)
    shapes = [[40], [10, 20, 5], [3] * 10, [1] * 30, [24, 24], [2] * 20, [48], [1] * 40]
    policy = default_buckets(T)  # capacity rungs 8, 32, 48: the shapes meet all three
    layers = [_block(seed) for seed in range(3)]
    graphed = capture_layers_with(EagerRecorder(), layers, (_x(0), _params([12, 3])), buckets=policy)

    def params(lengths):
        return PackedSeqParams.from_seqlens(lengths, total_tokens=T, capacity=len(lengths), max_seqlen=T)

    def step(stack, plan):
        kept, scores = [], []
        for layer in layers:
            layer.zero_grad(set_to_none=plan["set_to_none"])
        for seed, lengths, hook in plan["micro"]:
            h = _x(seed)
            for k, layer in enumerate(stack):
                h = layer(h, params(lengths))
                if hook and k < len(layers) - 1:
                    h.register_hook(kept.append)
            _loss(h).backward()
        with torch.no_grad():
            h = _x(99, requires_grad=False)
            for layer in stack:
                h = layer(h, params(plan["score"]))
            scores.append(h.clone())
        return kept, scores, [_grads(layer) for layer in layers]

    history = []
    for i in range(14):
        plan = {
            "set_to_none": rng.random() < 0.7,
            "micro": [(10 * i + m, rng.choice(shapes), rng.random() < 0.5) for m in range(rng.choice([1, 2]))],
            "score": rng.choice(shapes),
        }
        got, want = step(graphed, plan), step(layers, plan)
        history.append((got[0], want[0]))  # kept hidden-state grads: compared again at the end
        assert len(got[0]) == len(want[0])
        for g, w in zip(got[0] + got[1], want[0] + want[1], strict=True):
            torch.testing.assert_close(g, w, msg=f"step {i}")
        for g, w in zip(got[2], want[2], strict=True):
            _same_grads(g, w)
    for i, (got, want) in enumerate(history):  # nothing kept was overwritten by a later step
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, msg=f"kept at step {i}")
    assert graphed[0].num_graphs >= 3 and graphed[0].group.recorder.released


@pytest.mark.parametrize("handout_path", ["swap", "scan"], indirect=True)
def test_grads_kept_after_they_are_set_to_none_are_moved_without_a_scan(handout_path):
    """``grads = [p.grad ...]; p.grad = None`` each step, the list kept into the next step's forward: the adopted
    grads are known to the engine (a hook reports them where storages cannot be swapped), so keeping them costs a
    copy each and never a scan of the garbage collector's objects."""
    from tests.graphs.test_replay import _stack

    layers = _stack()
    graphed = capture_layers_with(EagerRecorder(), list(layers), (_x(0), SIGS["A"]))
    scans = memory.scans
    kept, want = [], []
    for step in range(4):
        for stack, out in ((graphed, kept), (list(layers), want)):
            x = _x(step)
            h = x
            for layer in stack:
                h = layer(h, SIGS["A"])
            _loss(h).backward()
            out.append([x.grad] + [w.grad for w in layers.parameters()])
            for w in layers.parameters():
                w.grad = None
    assert memory.scans == scans
    for got, ref in zip(kept, want, strict=True):
        for g, w in zip(got, ref, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("handout_path", ["swap", "scan"], indirect=True)
def test_an_alias_the_engine_never_saw_is_found_by_a_scan_without_a_swap(handout_path):
    block = _block()
    graphed = capture_with(EagerRecorder(), block, (_x(0), SIGS["A"]), forward_only=True)
    scans, settled = memory.scans, memory.settled_bytes
    with torch.no_grad():
        kept = graphed(_x(1), SIGS["A"]).detach()[2:]  # a view of a .detach(): the engine never saw either
        graphed(_x(2), SIGS["A"])
        torch.testing.assert_close(kept, block(_x(1), SIGS["A"])[2:], rtol=0, atol=0)
    assert memory.scans == scans + (handout_path == "scan")
    assert memory.settled_bytes == settled + kept.untyped_storage().nbytes()  # the whole output, once


@pytest.mark.parametrize("handout_path", ["scan"], indirect=True)
def test_the_scan_passes_over_dead_weak_proxies(handout_path):
    """The scan reads every object the garbage collector tracks. A ``weakref.proxy`` whose object is gone raises
    ReferenceError at any attribute read, ``isinstance`` included: another library's dead proxy must not break the
    scan (it did, in a test ordering that left one alive)."""
    import weakref

    class Target:
        pass

    target = Target()
    dead = [weakref.proxy(target)]
    del target
    block = _block()
    graphed = capture_with(EagerRecorder(), block, (_x(0), SIGS["A"]), forward_only=True)
    scans = memory.scans
    with torch.no_grad():
        kept = graphed(_x(1), SIGS["A"]).detach()[2:]  # an alias the engine never saw: only the scan finds it
        graphed(_x(2), SIGS["A"])
        torch.testing.assert_close(kept, block(_x(1), SIGS["A"])[2:], rtol=0, atol=0)
    assert memory.scans == scans + 1 and len(dead) == 1


@pytest.mark.parametrize("handout_path", ["swap", "scan"], indirect=True)
def test_an_output_autograd_saved_keeps_its_value_for_the_backward(handout_path):
    """An output saved by an eager op's autograd node, its Python tensor deleted: the node's tensor is still found
    and moved (without a swap, the scan reaches the Python object torch keeps for it)."""
    block = _block()
    graphed = capture_with(EagerRecorder(), block, (_x(0), SIGS["A"]), forward_only=True)
    with torch.no_grad():
        out = graphed(_x(1), SIGS["A"])
    w = torch.ones_like(out, requires_grad=True)
    product = (out * w).sum()  # autograd saves ``out`` for w's grad
    del out
    with torch.no_grad():
        graphed(_x(2), SIGS["A"])
    product.backward()
    torch.testing.assert_close(w.grad, block(_x(1), SIGS["A"]).detach(), rtol=0, atol=0)


@pytest.mark.parametrize("handout_path", ["scan"], indirect=True)
def test_without_a_swap_a_holder_no_scan_finds_is_refused_not_overwritten(handout_path, monkeypatch):
    block = _block()
    graphed = capture_with(EagerRecorder(), block, (_x(0), SIGS["A"]), forward_only=True)
    with torch.no_grad():
        kept = graphed(_x(1), SIGS["A"]).detach()
        monkeypatch.setattr(gc, "get_objects", lambda: [])  # as for a holder only C++ code keeps
        with pytest.raises(GraphOrderError, match="Python cannot reach"):
            graphed(_x(2), SIGS["A"])
    torch.testing.assert_close(kept, block(_x(1), SIGS["A"]).detach(), rtol=0, atol=0)


@pytest.mark.parametrize("handout_path", ["scan"], indirect=True)
def test_without_a_swap_memory_a_holder_no_scan_finds_is_kept_when_the_graphs_go(handout_path, monkeypatch):
    """When the engine lets go of a graph (its group collected), a holder it cannot move keeps the memory
    allocated (memory.KEPT_FOR_HOLDERS) rather than being left on memory the pool frees."""
    block = _block()
    graphed = capture_with(EagerRecorder(), block, (_x(0), SIGS["A"]), forward_only=True)
    with torch.no_grad():
        kept = graphed(_x(1), SIGS["A"]).detach()
    static = graphed.cache.values()[0].fwd.static_outputs[0]
    monkeypatch.setattr(gc, "get_objects", lambda: [])  # as for a holder only C++ code keeps
    before = len(memory.KEPT_FOR_HOLDERS)
    del graphed
    gc.collect()
    assert len(memory.KEPT_FOR_HOLDERS) == before + 1 and memory.KEPT_FOR_HOLDERS[-1] is static
    torch.testing.assert_close(kept, block(_x(1), SIGS["A"]).detach(), rtol=0, atol=0)
    memory.KEPT_FOR_HOLDERS.pop()
