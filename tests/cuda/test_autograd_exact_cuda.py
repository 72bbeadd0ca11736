"""Eager autograd is the spec, on the GPU: every case compares real CUDA graphs with the eager module on the same
inputs (the CPU stand-in runs the same cases in tests/graphs/test_autograd_exact.py).

Reference layer and tolerances as in test_graphs_cuda.py: ``Block`` in bf16, d=256, T=1024; forward within 1e-2,
each grad within 2e-2 of its eager max (FlashAttention's backward accumulates with atomics). ``.grad is None`` is
compared exactly.
"""

import copy
import random
import warnings

import pytest
import torch

from packgraph.buckets import default_buckets
from packgraph.graphs import GraphOrderError, capture, capture_layers
from packgraph.models.gpt import GPT, Block, GPTConfig
from packgraph.packing import PackedBatch
from packgraph.params import PackedSeqParams
from tests.cuda.test_graphs_cuda import CAPACITY, DEV, FWD_TOL, GRAD_RTOL, D, T, _block
from tests.graphs.test_backward_edge_cases import forward_keeping_hidden_grads

pytestmark = pytest.mark.cuda


def _params(lengths, capacity=CAPACITY, max_seqlen=T):
    return PackedSeqParams.from_seqlens(lengths, capacity=capacity, total_tokens=T, max_seqlen=max_seqlen, device=DEV)


def _x(seed, requires_grad=True):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(T, D, device=DEV, dtype=torch.bfloat16, generator=g).requires_grad_(requires_grad)


def _loss(out):
    w = torch.linspace(-1, 1, out.numel(), device=out.device, dtype=torch.float32).view_as(out)
    return (out.float() * w).sum()


def _grads(module):
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in module.named_parameters()}


def _close(a, b, what=""):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    scale = b.float().abs().max().clamp_min(1e-30)
    assert ((a.float() - b.float()).abs().max() / scale).item() <= GRAD_RTOL, what


def _same_grads(got, want):
    assert got.keys() == want.keys()
    for name in want:
        _close(got[name], want[name], name)


def test_autograd_grad_and_backward_inputs_touch_only_what_eager_touches(report):
    block = _block()
    p = _params([300, 0, 1, 500])
    graphed = capture(block, (_x(0), p))
    got = []
    for fn in (block, graphed):
        block.zero_grad(set_to_none=True)
        x = _x(1)
        (gx,) = torch.autograd.grad(_loss(fn(x, p)), [x])
        none_left = all(q.grad is None for q in block.parameters())
        x2 = _x(2)
        _loss(fn(x2, p)).backward(inputs=[x2, block.attn.qkv.weight])
        got.append((gx, none_left, x2.grad, _grads(block)))
    (gx_e, none_e, x2_e, ge), (gx_g, none_g, x2_g, gg) = got
    assert none_e and none_g
    _close(gx_g, gx_e, "x grad")
    _close(x2_g, x2_e, "x2 grad")
    _same_grads(gg, ge)
    assert gg["mlp.down.weight"] is None and gg["attn.qkv.weight"] is not None
    report("exact: autograd.grad / backward(inputs=) leave other .grad alone", 1)


def test_parameters_frozen_after_capture_get_no_grad(report):
    block = _block()
    p = _params([300, 0, 1, 500])
    graphed = capture(block, (_x(0), p))
    for frozen in ({"attn.qkv.weight"}, set()):
        for name, q in block.named_parameters():
            q.requires_grad_(name not in frozen)
        got = []
        for fn in (block, graphed):
            block.zero_grad(set_to_none=True)
            _loss(fn(_x(3), p)).backward()
            got.append(_grads(block))
        _same_grads(got[1], got[0])
        assert all(got[1][name] is None for name in frozen)
    report("exact: frozen-after-capture graphs", graphed.captures)


def test_reassigned_cu_seqlens_are_bucketed_from_their_values_not_stale_host_offsets(report):
    block = _block()
    policy = default_buckets(T)
    p = _params([100, 20], capacity=8)
    graphed = capture(block, (_x(0), p), buckets=policy)
    stale = _params([100, 20], capacity=8)
    new = torch.tensor([0, 1000, 1020] + [1020] * 6, dtype=torch.int32, device=DEV)  # same length, new values
    stale.cu_seqlens_q = new
    stale.cu_seqlens_kv = new
    true = _params([1000, 20], capacity=8, max_seqlen=1000)
    out = graphed(_x(1), stale)
    ref = block(_x(1), true)
    err = (out.float() - ref.float()).abs().max().item()
    report("exact: reassigned cu_seqlens max |graphed - eager|", err)
    assert err <= FWD_TOL


def test_default_buckets_serve_every_batch_without_eviction_and_with_eager_grads(report):
    block = _block()
    policy = default_buckets(T)
    graphed = capture(block, (_x(0), _params([T], capacity=1)), buckets=policy)
    hit = {policy.bucket_for(T, 1)}
    rng = random.Random(0)
    worst = 0.0
    for cycle in range(3):
        for max_seqlen in policy.max_seqlen_ladder:
            for capacity in policy.capacity_ladder:
                n = capacity
                lengths = [1] * n
                lengths[0] = min(max_seqlen, T - (n - 1))
                hit.add(policy.bucket_for(max(lengths), n))
                p = PackedSeqParams.from_seqlens(lengths, capacity=n, total_tokens=T, max_seqlen=T, device=DEV)
                seed = rng.randint(0, 100)
                results = []
                for fn in (block, graphed):
                    block.zero_grad(set_to_none=True)
                    x = _x(seed)
                    y = fn(x, p)
                    _loss(y).backward()
                    results.append((y.detach().float(), x.grad, _grads(block)))
                worst = max(worst, (results[1][0] - results[0][0]).abs().max().item())
                if cycle == 0:
                    _close(results[1][1], results[0][1], "x grad")
                    _same_grads(results[1][2], results[0][2])
    report("exact: buckets cycled x3, graphs captured", graphed.captures)
    report("exact: buckets in the default policy (T=1024)", policy.num_buckets)
    assert graphed.evictions == 0 and graphed.captures == len(hit) >= 8
    assert worst <= FWD_TOL


def test_a_batch_of_one_token_documents_fills_the_top_capacity_rung(report):
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=256, n_head=4, n_layer=2)).to(DEV)
    T4 = 4096
    policy = default_buckets(T4)
    docs = [torch.randint(0, 256, (1,)) for _ in range(600)]
    batch = PackedBatch.from_documents(docs, bin_size=T4, capacity=600, max_seqlen=1).to(DEV)
    graphed = model.graphed(scope="layer", buckets=policy)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss_g = graphed(batch)
        _, loss_e = model(batch)
    report("exact: 600 one-token documents at T=4096, loss graphed - eager", abs(loss_g.item() - loss_e.item()))
    assert abs(loss_g.item() - loss_e.item()) <= 1e-2 * abs(loss_e.item())


@pytest.mark.parametrize("input_grad", [True, False])
def test_a_forward_while_its_backward_is_pending_raises_and_the_backward_stays_right(input_grad):
    block = _block()
    p = _params([300, 0, 1, 500])
    graphed = capture(block, (_x(0, input_grad), p))
    first = graphed(_x(1, input_grad), p)
    with pytest.raises(GraphOrderError):
        graphed(_x(2, input_grad), p)
    with torch.no_grad(), pytest.raises(GraphOrderError):
        graphed(_x(2, input_grad), p)
    block.zero_grad(set_to_none=True)
    _loss(first).backward()
    got = _grads(block)
    block.zero_grad(set_to_none=True)
    _loss(block(_x(1, input_grad), p)).backward()
    _same_grads(got, _grads(block))


def test_double_backward_raises_a_clear_error():
    block = _block()
    p = _params([300, 0, 1, 500])
    graphed = capture(block, (_x(0), p))
    x = _x(1)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(_loss(graphed(x, p)), [x], create_graph=True)


def test_parameters_moved_after_capture_recapture_without_a_sync(report):
    block = _block()
    p = _params([300, 0, 1, 500])
    graphed = capture(block, (_x(0), p))
    ref = _block()
    fresh = {k: v.clone() * 1.5 for k, v in block.state_dict().items()}
    block.load_state_dict(fresh, assign=True)  # new storage: the old graph would read stale weights
    ref.load_state_dict(fresh)
    got = []
    for fn, module in ((graphed, block), (ref, ref)):
        module.zero_grad(set_to_none=True)
        y = fn(_x(1), p)
        _loss(y).backward()
        got.append((y.detach().float(), _grads(module)))
    err = (got[0][0] - got[1][0]).abs().max().item()
    _same_grads(got[0][1], got[1][1])
    x = _x(2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the per-call parameter check runs on the host: no sync
    try:
        _loss(graphed(x, p)).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    report("exact: load_state_dict(assign=True) max |graphed - eager|", err)
    assert err <= FWD_TOL and graphed.captures == 2


def test_gradient_hooks_fire_as_in_eager(report):
    block = _block()
    p = _params([300, 0, 1, 500])
    graphed = capture(block, (_x(0), p))
    results = []
    for fn in (block, graphed):
        seen = {"tensor": 0, "post": 0}
        handles = [block.attn.qkv.weight.register_hook(lambda g, s=seen: s.__setitem__("tensor", s["tensor"] + 1))]
        handles += [
            q.register_post_accumulate_grad_hook(lambda _, s=seen: s.__setitem__("post", s["post"] + 1))
            for q in block.parameters()
        ]
        block.zero_grad(set_to_none=True)
        for i in range(2):
            _loss(fn(_x(4 + i), p)).backward()
        results.append((seen, _grads(block)))
        for h in handles:
            h.remove()
    assert results[0][0] == results[1][0]
    _same_grads(results[1][1], results[0][1])
    report("exact: hook calls per 2 micro-batches", results[1][0]["post"])


def test_outputs_and_grads_held_across_replays_keep_their_values():
    block = _block()
    p = _params([300, 0, 1, 500])
    scorer = capture(block, (_x(0, False), p), forward_only=True)
    with torch.no_grad():
        held = [scorer(_x(i, False), p) for i in range(3)]
        for i, out in enumerate(held):
            assert (out.float() - block(_x(i, False), p).float()).abs().max().item() <= FWD_TOL
    graphed = capture(block, (_x(0), p))
    history = []
    for i in range(3):
        block.zero_grad(set_to_none=True)
        _loss(graphed(_x(i), p)).backward()
        history.append(block.attn.qkv.weight.grad)
    for i, g in enumerate(history):
        block.zero_grad(set_to_none=True)
        _loss(block(_x(i), p)).backward()
        _close(g, block.attn.qkv.weight.grad, f"step {i}")


def test_outputs_read_on_another_stream_survive_eviction_and_recapture():
    """Static memory of an evicted graph returns to the pool only after every stream is done with it: each capture
    synchronises the device before it allocates anything."""
    block = _block()
    graphed = capture(block, (_x(0, False), _params([300, 500])), forward_only=True, max_graphs=1)
    side = torch.cuda.Stream()
    with torch.no_grad():
        out = graphed(_x(1, False), _params([300, 500]))
        want = block(_x(1, False), _params([300, 500])).float() * 2
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # keep the side stream busy past the evictions below
            doubled = out.float() * 2
        del out
        for lengths in ([10, 20], [7, 7, 7]):  # each a new signature: evicts the previous graph, reuses its pool
            graphed(_x(2, False), _params(lengths, capacity=8 if len(lengths) < 3 else 32))
        torch.cuda.current_stream().wait_stream(side)
    assert graphed.evictions == 2
    assert (doubled - want).abs().max().item() <= 2 * FWD_TOL


def test_graphed_training_emits_no_warning():
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=256, n_head=4, n_layer=2)).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    docs = [torch.randint(0, 256, (n,)) for n in (300, 40, 500, 7)]
    batch = PackedBatch.from_documents(docs, bin_size=T, capacity=8, max_seqlen=T).to(DEV)
    other = PackedBatch.from_documents(docs[:2], bin_size=T, capacity=8, max_seqlen=512).to(DEV)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # eager first, as the demo does, then graphed with a capture mid-run
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model(batch)[1].backward()
        graphed = model.graphed(scope="layer", buckets=default_buckets(T))
        for b in (batch, batch, other, batch, other):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                graphed(b)[1].backward()
            opt.step()
        torch.cuda.synchronize()
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []


def test_capture_layers_stack_matches_eager_across_buckets_with_one_buffer_set(report):
    torch.manual_seed(0)
    layers = [Block(GPTConfig(d_model=D, n_head=4, n_layer=3)).to(DEV, torch.bfloat16) for _ in range(3)]
    policy = default_buckets(T)
    graphed = capture_layers(layers, (_x(0), _params([T], capacity=1)), buckets=policy)
    rng = random.Random(1)
    for step in range(12):
        n = rng.choice([1, 3, 20, 64])
        lengths = [rng.randint(1, T // n) for _ in range(n)]
        p = PackedSeqParams.from_seqlens(lengths, total_tokens=T, device=DEV)
        outs = []
        for stack in (layers, graphed):
            for layer in layers:
                layer.zero_grad(set_to_none=True)
            x = _x(step)
            h = x
            for layer in stack:
                h = layer(h, p)
            _loss(h).backward()
            outs.append((h.detach().float(), x.grad, [_grads(layer) for layer in layers]))
        assert (outs[1][0] - outs[0][0]).abs().max().item() <= FWD_TOL
        _close(outs[1][1], outs[0][1], "x grad")
        for g, e in zip(outs[1][2], outs[0][2], strict=True):
            _same_grads(g, e)
    for g in graphed:  # one output set per layer; each bucket's grads its own, released once idle
        first, *later = g.cache.values()
        assert later and all(
            all(a is b for a, b in zip(e.fwd.static_outputs, first.fwd.static_outputs, strict=True)) for e in later
        )
    released = [r for g in graphed for e in list(g.cache.values())[:-1] for r in e.bwd.grad_records if r is not None]
    assert released and all(r.released_at is not None for r in released)
    report("exact: stack buckets met", graphed[0].num_graphs)


_CAPACITY_OF = {"A": 4, "B": 8, "C": 16}  # one signature each


def _sig(name):
    return _params([300, 0, 1, 500], capacity=_CAPACITY_OF[name])


def _schedule_grads(fn, block, schedule, set_to_none):
    out = []
    block.zero_grad(set_to_none=True)
    for step, names in enumerate(schedule):
        block.zero_grad(set_to_none=set_to_none)
        for mb, name in enumerate(names):
            _loss(fn(_x(10 * step + mb), _sig(name))).backward()
        out.append(_grads(block))
    return out


def test_a_stack_whose_layers_change_signature_at_different_times_trains_as_eager(report):
    """A parameter of the stack's first layer frozen for a step, then unfrozen, and the last layer switched to eval
    and back, with one or two micro-batches: the head's graphs of a replaced stack generation are dropped, and a
    forward that would overwrite a pending graph is captured again in a pool of its own (it raised
    GraphOrderError). Real CUDA graphs against eager on the same inputs, every .grad and its None-ness."""
    torch.manual_seed(0)
    layers = [Block(GPTConfig(d_model=D, n_head=4, n_layer=3)).to(DEV, torch.bfloat16) for _ in range(3)]
    graphed = capture_layers(layers, (_x(0), _params([300, 500])), buckets=default_buckets(T))
    head = layers[0].mlp.down.weight
    schedule = [  # (head frozen, last layer in train mode, micro-batches)
        (False, True, [[300, 500]]), (True, True, [[300, 500]]), (False, True, [[300, 500]]),
        (False, True, [[300, 500], [100, 20, 5]]), (False, False, [[300, 500]]), (True, False, [[700]]),
        (False, True, [[700], [300, 500]]),
    ]  # fmt: skip
    for step, (frozen, train, batches) in enumerate(schedule):
        head.requires_grad_(not frozen)
        layers[2].train(train)
        outs = []
        for stack in (layers, graphed):
            for layer in layers:
                layer.zero_grad(set_to_none=True)
            got = []
            for k, lengths in enumerate(batches):
                x = _x(10 * step + k)
                h = x
                for layer in stack:
                    h = layer(h, _params(lengths))
                _loss(h).backward()
                got.append((h.detach().float(), x.grad))
            outs.append((got, [_grads(layer) for layer in layers]))
        for (h_g, x_g), (h_e, x_e) in zip(outs[1][0], outs[0][0], strict=True):
            assert (h_g - h_e).abs().max().item() <= FWD_TOL, f"step {step}"
            _close(x_g, x_e, f"x grad, step {step}")
        for g, e in zip(outs[1][1], outs[0][1], strict=True):
            _same_grads(g, e)
    report("exact: stack with per-layer signature changes, graphs captured by the head", graphed[0].captures)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_micro_batches_across_buckets_on_released_grads_match_eager(set_to_none, report):
    """Each bucket's grads go back to the pool once idle and a later capture may place its tensors there: grads
    held over a micro-batch of another bucket (captured in the middle of the step, or replayed) must be moved off
    that memory first."""
    schedule = ["AA", "AB", "BC", "CA", "B", "CB", "AAC", "CC"]
    block = _block()
    graphed = capture(block, (_x(0), _sig("A")))
    got = _schedule_grads(graphed, block, schedule, set_to_none)
    want = _schedule_grads(block, block, schedule, set_to_none)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for name in w:
            _close(g[name], w[name], f"step {step} {name}")
    released = sum(r.released_at is not None for e in graphed.cache.values() for r in e.bwd.grad_records if r)
    report(f"exact: grads released over the bucket schedule (set_to_none={set_to_none})", released)
    assert released > 0


def test_grads_held_across_buckets_and_after_the_graphs_go_keep_their_values():
    block = _block()
    graphed = capture(block, (_x(0), _sig("A")))
    order = "ABACBCA"
    history = []
    for i, name in enumerate(order):
        block.zero_grad(set_to_none=True)
        _loss(graphed(_x(i), _sig(name))).backward()
        history.append(block.mlp.down.weight.grad)  # no clone: eager keeps each step's tensor as it was
    del graphed
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    scribble = torch.full((64, 2**20), float("nan"), device=DEV)  # reuse whatever memory the pool gave back
    for i, name in enumerate(order):
        block.zero_grad(set_to_none=True)
        _loss(block(_x(i), _sig(name))).backward()
        _close(history[i], block.mlp.down.weight.grad, f"step {i}")
    del scribble


def test_hidden_state_grads_kept_by_hooks_match_eager_with_two_chained_buffers(report):
    """A stack's chained layers share two hidden-state grad buffers, each overwritten two layers later: a grad a
    hook keeps must be moved off first, as eager's stays as it was."""
    torch.manual_seed(0)
    layers = [Block(GPTConfig(d_model=D, n_head=4, n_layer=4)).to(DEV, torch.bfloat16) for _ in range(4)]
    graphed = capture_layers(layers, (_x(0), _sig("A")), buckets=default_buckets(T))
    got = []
    for stack in (layers, graphed):
        kept = []
        for step, name in enumerate("ABAB"):
            for layer in layers:
                layer.zero_grad(set_to_none=True)
            h = _x(step)
            for k, layer in enumerate(stack):
                h = layer(h, _sig(name))
                if k < len(layers) - 1:
                    h.register_hook(kept.append)
            _loss(h).backward()
        got.append([g.float() for g in kept])
    assert len(got[0]) == len(got[1]) == 12
    for i, (g, w) in enumerate(zip(got[1], got[0], strict=True)):
        _close(g, w, f"hidden-state grad {i}")
    chain = {id(r.static) for g in graphed for e in g.cache.values() for r in e.bwd.chain_records.values()}
    report("exact: chained grad buffers in a 4-layer stack over 2 buckets", len(chain))
    assert len(chain) == 2


def test_a_hidden_state_grad_kept_by_a_hook_keeps_its_values_after_a_layer_is_recaptured(report):
    """A stack's layer recaptured alone (a forward hook added) may write the other chained grad buffer than the one
    its producer's older graph reads in place: the grad is then copied into that buffer, and a grad a tensor hook
    kept on it moves first. The CPU fuzz found the kept grad overwritten there (tests/graphs/test_backward_edge_cases.py
    has the CPU case)."""
    layers = [_block(seed=seed) for seed in range(3)]
    eager = copy.deepcopy(layers)
    graphed = capture_layers(layers, (_x(0), _sig("A")), buckets=default_buckets(T))
    results = []
    for stack, modules in ((graphed, layers), (eager, eager)):
        pending = forward_keeping_hidden_grads(stack, _x(9), _sig("B"))
        try:
            with torch.no_grad():
                forward_keeping_hidden_grads(stack, _x(5009, requires_grad=False), _sig("A"))
        except GraphOrderError:
            assert stack is graphed  # the engine's named refusal; eager runs it
        del pending
        _loss(forward_keeping_hidden_grads(stack, _x(10, requires_grad=False), _sig("C"))).backward()
        modules[1].register_forward_hook(lambda m, a, o: o * 0.5)
        kept = []
        out = forward_keeping_hidden_grads(stack, _x(20, requires_grad=False), _sig("B"), kept)
        _loss(out).backward()
        results.append((out.detach(), kept, [_grads(m) for m in modules]))
    (out, kept, grads), (eager_out, eager_kept, eager_grads) = results
    _close(out, eager_out, "output")
    assert len(kept) == len(eager_kept) == 2
    for i, (a, b) in enumerate(zip(kept, eager_kept, strict=True)):
        _close(a, b, f"kept hidden-state grad {i}")
    for a, b in zip(grads, eager_grads, strict=True):
        _same_grads(a, b)
    report("exact: hidden-state grads kept by hooks after a layer is recaptured alone", "eager's")


class _LossOf(torch.nn.Module):
    """The whole loss as the graphed callable's output, as ``model.graphed(scope="model")`` has it."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, p):
        return _loss(self.block(x, p))


def test_aliases_of_outputs_kept_across_replays_keep_their_values_without_a_sync(report):
    """Eager keeps every tensor a caller holds: slices, ``.detach()`` and views of outputs kept across replays, and
    ``logged = loss.detach(); loss.backward()``. Each keeps its values on real graphs, also after the graphs are
    gone and their memory reused, and keeping them costs no host sync (the copies are stream-ordered)."""
    block = _block()
    p = _params([300, 0, 1, 500])
    scorer = capture(block, (_x(0, False), p), forward_only=True)
    loss_graph = capture(_LossOf(block), (_x(0), p))
    kept, logged, grads = [], [], []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(3):
            with torch.no_grad():
                out = scorer(_x(i, False), p)
            kept.append((out[:64], out.detach(), out.detach()[8:].t()))
            block.zero_grad(set_to_none=True)
            loss = loss_graph(_x(i), p)
            logged.append(loss.detach())
            loss.backward()
            grads.append(_grads(block))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    del scorer, loss_graph
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    scribble = torch.full((64, 2**20), float("nan"), device=DEV)  # whatever memory the pools gave back
    worst = 0.0
    for i in range(3):
        with torch.no_grad():
            want = block(_x(i, False), p).float()
        for got, ref in zip(kept[i], (want[:64], want, want[8:].t()), strict=True):
            worst = max(worst, (got.float() - ref).abs().max().item())
        block.zero_grad(set_to_none=True)
        loss = _loss(block(_x(i), p))
        loss.backward()
        assert abs(logged[i].item() - loss.item()) <= 1e-2 * max(1.0, abs(loss.item())), f"step {i}"
        _same_grads(grads[i], _grads(block))
    del scribble
    report("exact: outputs kept across replays, max |kept - eager|", worst)
    assert worst <= FWD_TOL


def test_a_submodule_swapped_after_capture_is_recaptured_without_a_sync(report):
    """``model[1] = nn.Linear(...)`` after capture: the graphs replayed the old submodule and the new one got no
    grads. The module tree is checked on the host at every call: the graphs are captured again, and outputs and
    grads (the new submodule's included) are eager's."""
    model = torch.nn.Sequential(_block(), torch.nn.Linear(D, D).to(DEV, torch.bfloat16))
    p = _params([300, 0, 1, 500])
    graphed = capture(_Chain(model), (_x(0), p))
    _loss(graphed(_x(1), p)).backward()
    torch.manual_seed(5)
    model[1] = torch.nn.Linear(D, D).to(DEV, torch.bfloat16)
    got = []
    for fn in (graphed, _Chain(model)):
        model.zero_grad(set_to_none=True)
        y = fn(_x(2), p)
        _loss(y).backward()
        got.append((y.detach().float(), _grads(model)))
    err = (got[0][0] - got[1][0]).abs().max().item()
    _same_grads(got[0][1], got[1][1])
    assert got[0][1]["1.weight"] is not None
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the tree check runs on the host
    try:
        _loss(graphed(_x(3), p)).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    report("exact: submodule swapped after capture, max |graphed - eager|", err)
    assert err <= FWD_TOL and graphed.captures == 2


class _Chain(torch.nn.Module):
    def __init__(self, seq):
        super().__init__()
        self.seq = seq

    def forward(self, x, p):
        return self.seq[1](self.seq[0](x, p))


def _retained_twice(fn, module, between=None):
    module.zero_grad(set_to_none=True)
    x = _x(1)
    loss = _loss(fn(x, _params([300, 0, 1, 500])))
    loss.backward(retain_graph=True)
    if between is not None:
        between()
    loss.backward()
    return x.grad.clone(), _grads(module)


def test_a_retained_backward_runs_again_as_eager_or_is_refused_after_another_call(report):
    """A second backward through a retained graph (retain_graph=True), each graph keeping its activations: eager's
    grads when nothing or another signature ran in between; after a replay of its own graph, a named refusal (the
    replay overwrote what it reads: the CPU fuzz found wrong grads there). Sharing activations, refused at once: the
    backward graph reuses the memory of activations it has read (its second replay read NaNs here).
    tests/graphs/test_backward_edge_cases.py has the CPU cases."""
    block = _block()
    shared = capture(block, (_x(0), _params([300, 0, 1, 500])))
    with pytest.raises(RuntimeError, match="its first backward.*share_activations=False"):
        _retained_twice(shared, block)
    del shared
    eager = _block()
    eager.load_state_dict(block.state_dict())
    graphed = capture(block, (_x(0), _params([300, 0, 1, 500])), share_activations=False)
    gx, grads = _retained_twice(graphed, block)
    ex, eager_grads = _retained_twice(eager, eager)
    _close(gx, ex, "x.grad")
    _same_grads(grads, eager_grads)

    def other_signature(fn):
        with torch.no_grad():
            fn(_x(2), _params([64] * 8, max_seqlen=64))  # its own graphs, writing none of this one's memory

    gx, grads = _retained_twice(graphed, block, lambda: other_signature(graphed))
    ex, eager_grads = _retained_twice(eager, eager, lambda: other_signature(eager))
    _close(gx, ex, "x.grad, another signature between")
    _same_grads(grads, eager_grads)

    def same_graph():
        with torch.no_grad():
            graphed(_x(2), _params([300, 0, 1, 500]))

    with pytest.raises(RuntimeError, match="second backward through this call's autograd graph"):
        _retained_twice(graphed, block, same_graph)
    report("retained backward twice: shared activations / own activations / own, after its own graph ran",
           "refused / eager's grads / refused")  # fmt: skip


def test_a_bucket_met_first_without_grad_trains_after_an_optimizer_step_as_eager(report):
    """Evaluation meets a signature first (its forward captured, its backward at first use), the optimizer steps,
    then training meets it: eager's grads (the late capture refused this on the parameters' version counters)."""
    block = _block()
    eager = _block()
    eager.load_state_dict(block.state_dict())
    graphed = capture(block, (_x(0), _params([300, 0, 1, 500])))
    results = []
    for fn, module in ((graphed, block), (eager, eager)):
        with torch.no_grad():
            fn(_x(1), _params([64] * 8, max_seqlen=64))  # a new signature
            for p in module.parameters():
                p.mul_(0.999)  # in place, as an optimizer step updates them
        module.zero_grad(set_to_none=True)
        _loss(fn(_x(2), _params([64] * 8, max_seqlen=64))).backward()
        results.append(_grads(module))
    _same_grads(*results)
    report("signature met under no_grad, then trained after an in-place parameter update", "eager's grads")


def test_a_forward_only_graph_refuses_a_call_under_grad():
    block = _block()
    scorer = capture(block, (_x(0, requires_grad=False), _params([300, 0, 1, 500])), forward_only=True)
    with pytest.raises(RuntimeError, match="forward_only=True"):
        scorer(_x(1), _params([300, 0, 1, 500]))
