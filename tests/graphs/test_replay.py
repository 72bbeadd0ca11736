"""The capture/replay machinery of packgraph.graphs on the CPU, against eager runs.

CUDA graphs need a GPU, so these tests swap the recorder: :class:`EagerRecorder` "records" a graph by keeping the
capture body and "replays" it by running the body again and writing the results into the tensors the capture
returned, which is exactly the static-memory contract of a CUDA graph (same inputs read from the same buffers,
results land in the same outputs, side effects such as in-graph grad accumulation happen at every replay).
Everything else (signatures, buffers, copies, the autograd glue, grad accumulation, caches, chaining) is the
production code. The real graphs are tested on the H200 in tests/cuda/.
"""

import logging
import random
import time

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import packgraph.graphs as graphs
from packgraph.buckets import default_buckets
from packgraph.graphs import GraphSignatureError
from packgraph.graphs.capture import GraphedCallable, capture_layers_with, capture_with
from packgraph.graphs.entry import Entry
from packgraph.graphs.memory import GraphOrderError
from packgraph.models.gpt import Block, GPTConfig
from packgraph.ops import varlen_attention
from packgraph.params import PackedSeqParams, PackedSeqParamsError
from tests.eager_recorder import CaptureLikeRecorder, EagerRecorder

T, D = 48, 32


class NullGraph:
    replays = 0

    def replay(self):
        pass


class NullRecorder(EagerRecorder):
    """Records nothing: replays are free, so what is left of a call is the engine's own host work."""

    def warmup(self, run, iters, pool=None):
        run()

    def record(self, body, pool=None):
        return NullGraph(), body()


def _model(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return Block(GPTConfig(d_model=D, n_head=4, n_layer=2, vocab_size=50, dropout=dropout)).double()


def _params(lengths, capacity=8, max_seqlen=T, pad=1):
    return PackedSeqParams.from_seqlens(
        lengths, capacity=capacity, total_tokens=T, max_seqlen=max_seqlen, pad_to_multiple=pad
    )


def _random_lengths(rng, capacity=8, pad=1):
    lengths, room = [], T
    for _ in range(rng.randint(1, capacity)):
        n = rng.choice([0, 1, rng.randint(0, room)])
        footprint = -(-n // pad) * pad
        if footprint > room:
            break
        lengths.append(n)
        room -= footprint
    return lengths


def _x(seed, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, D, dtype=torch.float64, generator=g).requires_grad_(requires_grad)


def _weighted_sum(out):
    """A loss whose grad differs per element (a plain sum would hide swapped rows)."""
    return (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()


def _eager_grads(module, x, *args):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(x.requires_grad)
    out = module(x, *args)
    _weighted_sum(out).backward()
    return out.detach(), (x.grad if x.requires_grad else None), [p.grad.clone() for p in module.parameters()]


def _graphed_grads(module, graphed, x, *args):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(x.requires_grad)
    out = graphed(x, *args)
    _weighted_sum(out).backward()
    return out.detach().clone(), (x.grad if x.requires_grad else None), [p.grad.clone() for p in module.parameters()]


def _assert_same(a, b):
    torch.testing.assert_close(a[0], b[0])
    if a[1] is not None or b[1] is not None:
        torch.testing.assert_close(a[1], b[1])
    for ga, gb in zip(a[2], b[2], strict=True):
        torch.testing.assert_close(ga, gb)


class CopyCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.copies += 1
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------------ correctness
def test_layer_matches_eager_over_random_packings():
    rng = random.Random(0)
    block = _model()
    sample = _params([10, 0, 20, 5])
    graphed = capture_with(EagerRecorder(), block, (_x(0), sample))
    for i in range(12):
        pad = 1 if i % 3 else 4
        p = _params(_random_lengths(rng, pad=pad), pad=pad)
        _assert_same(_graphed_grads(block, graphed, _x(i + 1), p), _eager_grads(block, _x(i + 1), p))
    assert graphed.num_graphs == 2  # with and without padded offsets: two signatures


@pytest.mark.parametrize("scope", ["attn", "mlp"])
def test_partial_scopes_match_eager(scope):
    block = _model()
    p = _params([7, 1, 0, 30])
    x = _x(3)
    if scope == "attn":
        part = capture_with(EagerRecorder(), block.attn, (_x(1), _params([5, 5])))

        def forward(h, params):
            return block.mlp(part(h, params))
    else:
        part = capture_with(EagerRecorder(), block.mlp, (_x(1),))

        def forward(h, params):
            return part(block.attn(h, params))

    got = _graphed_grads(block, forward, x, p)
    _assert_same(got, _eager_grads(block, x, p))
    assert part.num_graphs == 1


def test_param_grads_accumulate_like_eager_microbatches():
    block = _model()
    p = _params([10, 20, 5])
    graphed = capture_with(EagerRecorder(), block, (_x(0), p))
    block.zero_grad(set_to_none=True)
    for i in range(4):
        block(_x(i), p).sum().backward()
    eager = [q.grad.clone() for q in block.parameters()]
    block.zero_grad(set_to_none=True)
    for i in range(4):
        graphed(_x(i), p).sum().backward()
    for q, ref in zip(block.parameters(), eager, strict=True):
        torch.testing.assert_close(q.grad, ref)
    # zero_grad(set_to_none=True) then one step: one step's grads, adopted from the graph's memory (no copy: the
    # same addresses step after step)
    block.zero_grad(set_to_none=True)
    graphed(_x(0), p).sum().backward()
    addresses = [q.grad.data_ptr() for q in block.parameters()]
    block.zero_grad(set_to_none=True)  # eager reference for one step, into fresh tensors
    block(_x(0), p).sum().backward()
    one = [q.grad.clone() for q in block.parameters()]
    block.zero_grad(set_to_none=True)
    graphed(_x(0), p).sum().backward()
    for q, ref, ptr in zip(block.parameters(), one, addresses, strict=True):
        assert q.grad.data_ptr() == ptr
        torch.testing.assert_close(q.grad, ref)
    # a grad tensor assigned by the caller is added to, not replaced
    for q in block.parameters():
        q.grad = torch.ones_like(q)
    graphed(_x(0), p).sum().backward()
    for q, ref in zip(block.parameters(), one, strict=True):
        torch.testing.assert_close(q.grad, ref + 1)


def test_param_grad_hooks_fire_as_in_eager():
    block = _model()
    p = _params([10, 20, 5])
    graphed = capture_with(EagerRecorder(), block, (_x(0), p))
    hooked = []
    first = next(block.parameters())
    handle = first.register_post_accumulate_grad_hook(lambda t: hooked.append(1))
    block.zero_grad(set_to_none=True)
    for i in range(3):
        graphed(_x(i), p).sum().backward()
    got = [q.grad.clone() for q in block.parameters()]
    assert len(hooked) == 3  # grads went through autograd's accumulation: hooks fire
    handle.remove()
    block.zero_grad(set_to_none=True)
    for i in range(3):
        block(_x(i), p).sum().backward()
    for q, g in zip(block.parameters(), got, strict=True):
        torch.testing.assert_close(g, q.grad)


def test_params_train_when_inputs_need_no_grad():
    block = _model()
    p = _params([12, 12])
    graphed = capture_with(EagerRecorder(), block, (_x(0, requires_grad=False), p))
    x = _x(5, requires_grad=False)
    _assert_same(_graphed_grads(block, graphed, x, p), _eager_grads(block, x, p))


def test_leaf_input_grads_accumulate_without_aliasing():
    block = _model()
    p = _params([12, 30])
    graphed = capture_with(EagerRecorder(), block, (_x(0), p))
    x = _x(7)
    graphed(x, p).sum().backward()
    first = x.grad.clone()
    graphed(x, p).sum().backward()  # would double-count if x.grad aliased the graph's grad buffer
    torch.testing.assert_close(x.grad, 2 * first)
    y = _x(7)
    block(y, p).sum().backward()
    torch.testing.assert_close(first, y.grad)


class _Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D).double()

    def forward(self, x, scale, *, bias):
        h = self.lin(x) * scale + bias
        return {"h": h, "pair": (h.sum(-1), (h > 0).long()), "k": 3}


def test_pytree_outputs_and_non_differentiable_leaves():
    heads = _Heads()
    x, bias = _x(1), torch.randn(D, dtype=torch.float64, requires_grad=True)
    graphed = capture_with(EagerRecorder(), heads.forward, (x, 2.0), {"bias": bias})
    assert graphed.module is heads  # a bound method trains its module's parameters
    x2, b2 = _x(2), bias.detach().clone().requires_grad_()
    out = graphed(x2, 2.0, bias=b2)
    ref = heads(x2.detach().clone(), 2.0, bias=bias)
    assert out["k"] == 3 and out["pair"][1].dtype == torch.long and not out["pair"][1].requires_grad
    torch.testing.assert_close(out["h"], ref["h"])
    torch.testing.assert_close(out["pair"][1], ref["pair"][1])
    heads.zero_grad(set_to_none=True)
    (out["h"].sum() + out["pair"][0].sum()).backward()
    got = [w.grad.clone() for w in heads.parameters()]
    heads.zero_grad(set_to_none=True)
    xr, br = x2.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    r = heads(xr, 2.0, bias=br)
    (r["h"].sum() + r["pair"][0].sum()).backward()
    torch.testing.assert_close(x2.grad, xr.grad)
    torch.testing.assert_close(b2.grad, br.grad)
    for g, w in zip(got, heads.parameters(), strict=True):
        torch.testing.assert_close(g, w.grad)


def test_forward_only_matches_eager():
    block = _model()
    p = _params([10, 3, 30])
    graphed = capture_with(EagerRecorder(), block, (_x(0), p), forward_only=True)
    (entry,) = graphed.cache.values()
    assert entry.bwd is None and entry.trainable == []
    with torch.no_grad():
        ref = block(_x(4), p)
        out = graphed(_x(4), p)
    assert not out.requires_grad
    torch.testing.assert_close(out, ref)
    with pytest.raises(RuntimeError, match="forward_only=True"):  # eager's output would require grad
        graphed(_x(4), p)


# ------------------------------------------------------------------------------------------------ signatures
def test_recapture_lru_and_logs(caplog):
    lin = nn.Linear(D, D).double()
    graphed = capture_with(EagerRecorder(), lin, (torch.randn(4, D, dtype=torch.float64),), max_graphs=2)
    with caplog.at_level(logging.INFO, logger="packgraph.graphs"):
        for n in (5, 6, 4, 5):
            x = torch.randn(n, D, dtype=torch.float64)
            torch.testing.assert_close(graphed(x), lin(x))  # never a stale graph: each shape its own
    assert graphed.captures == 5 and graphed.recaptures == 4 and graphed.num_graphs == 2
    assert graphed.evictions == 3
    assert [s.args[0].shape[0] for s in graphed.signatures] == [4, 5]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 4 and all("captured" in m for m in infos)
    assert sum("evicted" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) == 3


def test_error_mode_rejects_and_keeps_working():
    block = _model()
    p = _params([10, 20])
    graphed = capture_with(EagerRecorder(), block, (_x(0), p), on_mismatch="error")
    with pytest.raises(GraphSignatureError) as info:
        graphed(_x(1).float(), _params([10, 20], max_seqlen=24))
    fields = [d[0] for d in info.value.diffs]
    assert fields == ["args[0].dtype", "args[1].max_seqlen_q", "args[1].max_seqlen_kv"]
    block.eval()
    with pytest.raises(GraphSignatureError, match="module.training"):
        graphed(_x(1), p)
    block.train()
    _assert_same(_graphed_grads(block, graphed, _x(2), p), _eager_grads(block, _x(2), p))
    assert graphed.captures == 1


def test_mamba_fields_do_not_recapture_attention_graphs():
    block = _model()
    base = _params([10, 20])
    graphed = capture_with(EagerRecorder(), block.attn, (_x(0), base))
    for total in (T, T + 16, T + 100):
        p = base.replace(total_tokens=total, host_offsets=base.host_offsets).with_seq_idx()
        torch.testing.assert_close(graphed(_x(1), p), block.attn(_x(1), base))
    assert graphed.captures == 1
    keep = capture_with(EagerRecorder(), block.attn, (_x(0), base), keep_mamba_fields=True)
    keep(_x(1), base.replace(total_tokens=T + 16, host_offsets=base.host_offsets))
    assert keep.captures == 2


def test_buckets_map_true_params_onto_few_graphs():
    rng = random.Random(1)
    block = _model()
    policy = default_buckets(T)
    graphed = capture_with(
        EagerRecorder(), block, (_x(0), PackedSeqParams.from_seqlens([T], total_tokens=T)), buckets=policy
    )
    seen = set()
    for i in range(10):
        lengths = [n for n in _random_lengths(rng, capacity=12) if n]
        p = PackedSeqParams.from_seqlens(lengths, total_tokens=T)  # true capacity and max_seqlen
        seen.add(policy.bucket_of(p))
        _assert_same(_graphed_grads(block, graphed, _x(i), p), _eager_grads(block, _x(i), p))
    assert graphed.num_graphs == len(seen) <= policy.num_buckets


def test_training_mode_and_autocast_are_in_the_signature():
    lin = nn.Linear(D, D)
    graphed = capture_with(EagerRecorder(), lin, (torch.randn(4, D),))
    lin.eval()
    graphed(torch.randn(4, D))
    lin.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.randn(4, D)
        out = graphed(x)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, lin(x))
    assert graphed.captures == 3 and graphed.signatures[-1].autocast == torch.bfloat16


def test_the_attention_kernel_switch_is_in_the_signature():
    """A graph bakes in the attention kernel that the params' ``short_docs_min_slots`` selects: params with another
    value select another graph (or raise under on_mismatch="error", naming the field), never the stale one."""
    p = _params([10, 20])
    graphed = capture_with(EagerRecorder(), _model(), (_x(0), p))
    strict = capture_with(EagerRecorder(), _model(), (_x(0), p), on_mismatch="error")
    other = p.replace(short_docs_min_slots=513)
    graphed(_x(1), other).sum().backward()
    assert graphed.captures == 2
    with pytest.raises(GraphSignatureError, match="short_docs_min_slots"):
        strict(_x(1), other)


# ------------------------------------------------------------------------------------------------ bad input
def test_invalid_params_rejected_before_any_copy():
    block = _model()
    p = _params([10, 20])
    graphed = capture_with(EagerRecorder(), block, (_x(0), p))
    (entry,) = graphed.cache.values()
    graphed(_x(1), _params([4, 4, 4])).sum().backward()
    snapshot = [buf.clone() for _, _, buf, _ in entry.load_plan]
    replays = entry.fwd.graph.replays
    bad = [
        _params([10, 20]).replace(max_seqlen_q=5, host_offsets=p.host_offsets),  # below a real length
        _params([10, 20]).replace(
            host_offsets={"cu_seqlens_q": (0, 10, 8, 8, 8, 8, 8, 8, 8), "cu_seqlens_kv": (0, 10, 8, 8, 8, 8, 8, 8, 8)}
        ),  # decreasing
        _params([10, 20]).replace(cu_seqlens_q=p.cu_seqlens_q.long()),  # wrong dtype: structural
    ]
    for params in bad:
        with pytest.raises(PackedSeqParamsError):
            graphed(_x(2), params)
    for (_, _, buf, _), before in zip(entry.load_plan, snapshot, strict=True):
        assert torch.equal(buf, before)  # nothing was copied
    assert entry.fwd.graph.replays == replays and graphed.num_graphs == 1
    good = _params([3, 30, 1])
    _assert_same(_graphed_grads(block, graphed, _x(3), good), _eager_grads(block, _x(3), good))


def test_validate_off_lets_anything_through():
    lin = nn.Linear(D, D).double()

    def fn(x, params):
        return lin(x) * (params.max_seqlen_q / T)

    p = _params([10])
    graphed = capture_with(EagerRecorder(), fn, (_x(0), p), validate="off")
    graphed(_x(1), p.replace(max_seqlen_q=1, host_offsets=p.host_offsets))  # would be rejected by "host"
    assert graphed.captures == 2


# ------------------------------------------------------------------------------------------------ layer stacks
def _stack(n=3):
    torch.manual_seed(0)
    cfg = GPTConfig(d_model=D, n_head=4, n_layer=n, vocab_size=50)
    return nn.ModuleList(Block(cfg) for _ in range(n)).double()


def _run_stack(layers, x, p):
    for layer in layers:
        x = layer(x, p)
    return x


def _assert_stack_matches_eager(layers, out, x, q, seed):
    """``out`` and the grads its ``pow(2).sum()`` left in ``x`` and the layers: eager's, on ``_x(seed)``."""
    got = (out.detach().clone(), x.grad, [w.grad.clone() for w in layers.parameters()])
    layers.zero_grad(set_to_none=True)
    xr = _x(seed)
    ref = _run_stack(layers, xr, q)
    ref.pow(2).sum().backward()
    _assert_same(got, (ref.detach(), xr.grad, [w.grad for w in layers.parameters()]))


def test_capture_layers_chain_matches_eager_without_copies():
    layers = _stack()
    p = _params([10, 0, 20, 5])
    graphed = capture_layers_with(EagerRecorder(), list(layers), (_x(0), p))
    entries = [g.cache.values()[0] for g in graphed]
    # layer k reads layer k-1's output in place, and layer k-1's backward reads layer k's input grad in place
    for prev, nxt in zip(entries, entries[1:], strict=False):
        assert nxt.static_inputs[0].data_ptr() == prev.fwd.static_outputs[0].data_ptr()
        assert all(i != 0 for i, *_ in nxt.load_plan)
        assert prev.bwd.static_grad_outputs[0] is nxt.bwd.static_grad_inputs[0]
    for i in range(3):
        q = _params([5 + i, 17, 0, 2])
        layers.zero_grad(set_to_none=True)
        x = _x(i + 1)
        out = _run_stack(graphed, x, q)
        out.pow(2).sum().backward()
        got = (out.detach().clone(), x.grad, [w.grad.clone() for w in layers.parameters()])
        layers.zero_grad(set_to_none=True)
        xr = _x(i + 1)
        ref = _run_stack(layers, xr, q)
        ref.pow(2).sum().backward()
        _assert_same(got, (ref.detach(), xr.grad, [w.grad for w in layers.parameters()]))
    assert [g.captures for g in graphed] == [1, 1, 1]


def _log_captures(monkeypatch, graphed):
    """The ``("fwd" | "bwd", layer)`` of every capture from now on, in order."""
    names = {id(g): k for k, g in enumerate(graphed)}
    order = []
    fwd, bwd = Entry._capture_forward, Entry.capture_backward

    def log_fwd(self):
        order.append(("fwd", names[id(self.owner)]))
        return fwd(self)

    def log_bwd(self, given=None, **kwargs):
        order.append(("bwd", names[id(self.owner)]))
        bwd(self, given, **kwargs)

    monkeypatch.setattr(Entry, "_capture_forward", log_fwd)
    monkeypatch.setattr(Entry, "capture_backward", log_bwd)
    return order


def test_recaptured_stack_is_captured_whole_at_the_first_layer_and_chains_grads(monkeypatch):
    """A signature first met by a training call is new to every layer of the stack: the first layer's call captures
    all of them, forwards in order then backwards in reverse (as the initial capture does), before the rest of the
    step allocates; the step then only replays, and outputs and grads are eager's."""
    layers = _stack()
    graphed = capture_layers_with(EagerRecorder(), list(layers), (_x(0), _params([10, 0, 20, 5])))
    order = _log_captures(monkeypatch, graphed)
    q = _params([6, 6, 6], pad=2)  # padded offsets: a new signature
    layers.zero_grad(set_to_none=True)
    x = _x(3)
    out = graphed[0](x, q)
    assert order == [("fwd", 0), ("fwd", 1), ("fwd", 2), ("bwd", 2), ("bwd", 1), ("bwd", 0)]
    out = _run_stack(graphed[1:], out, q)
    out.pow(2).sum().backward()
    assert len(order) == 6  # nothing captured after the first layer's call
    new = [g.cache.values()[-1] for g in graphed]
    for prev, nxt in zip(new, new[1:], strict=False):
        assert nxt.static_inputs[0].data_ptr() == prev.fwd.static_outputs[0].data_ptr()
        assert prev.bwd.static_grad_outputs[0] is nxt.bwd.static_grad_inputs[0]
    _assert_stack_matches_eager(layers, out, x, q, 3)
    assert [g.captures for g in graphed] == [2, 2, 2]
    assert [g.recaptures for g in graphed] == [1, 1, 1]


def test_capture_ahead_captures_a_new_signature_on_the_input_buffer_before_the_input_exists(monkeypatch):
    """``capture_ahead`` captures the whole stack for the coming call's signature with the first layer's input
    buffer standing in for the input (its values are the last call's, which a capture only warms up on). The call
    itself then only replays, and outputs and grads are eager's on the real input."""
    layers = _stack()
    graphed = capture_layers_with(EagerRecorder(), list(layers), (_x(0), _params([10, 0, 20, 5])))
    buf = graphed[0].buffers.primary(("input", 0))
    assert buf is not None and buf.shape == (T, D)
    order = _log_captures(monkeypatch, graphed)
    q = _params([6, 6, 6], pad=2)  # a new signature
    assert graphed[0].capture_ahead((T, D), torch.float64, True, q)
    assert order == [("fwd", 0), ("fwd", 1), ("fwd", 2), ("bwd", 2), ("bwd", 1), ("bwd", 0)]
    assert graphed[0].cache.values()[-1].static_inputs[0] is buf  # the stand-in was the buffer itself
    assert not graphed[0].capture_ahead((T, D), torch.float64, True, q)  # known now: nothing to do
    layers.zero_grad(set_to_none=True)
    x = _x(3)
    out = _run_stack(graphed, x, q)
    out.pow(2).sum().backward()
    assert len(order) == 6  # the call replayed what capture_ahead captured
    _assert_stack_matches_eager(layers, out, x, q, 3)
    assert [g.captures for g in graphed] == [2, 2, 2]


def test_capture_ahead_leaves_to_the_call_what_it_cannot_capture_as_the_call_would(monkeypatch):
    """No capture where the call would not capture the whole stack, or where the input buffer's layout is not the
    coming input's (another dtype, shape or grad flag would be another signature): the call captures as before."""
    layers = _stack()
    graphed = capture_layers_with(EagerRecorder(), list(layers), (_x(0), _params([10, 0, 20, 5])))
    order = _log_captures(monkeypatch, graphed)
    q = _params([6, 6, 6], pad=2)
    assert not graphed[0].capture_ahead((T, D), torch.float32, True, q)
    assert not graphed[0].capture_ahead((T + 1, D), torch.float64, True, q)
    assert not graphed[0].capture_ahead((T, D), torch.float64, False, q)
    with torch.no_grad():
        assert not graphed[0].capture_ahead((T, D), torch.float64, True, q)  # forwards only: each at its call
    assert not graphed[1].capture_ahead((T, D), torch.float64, True, q)  # not the stack's first layer
    assert order == []
    bad = _params([10, 20]).replace(max_seqlen_q=5, host_offsets=_params([10, 20]).host_offsets)
    with pytest.raises(PackedSeqParamsError):  # invalid params raise here, as at the call
        graphed[0].capture_ahead((T, D), torch.float64, True, bad)
    layers.zero_grad(set_to_none=True)
    x = _x(3)
    out = _run_stack(graphed, x, q)
    out.pow(2).sum().backward()
    assert order[:3] == [("fwd", 0), ("fwd", 1), ("fwd", 2)]  # the call captured, whole, at the first layer
    _assert_stack_matches_eager(layers, out, x, q, 3)


def test_recapture_without_grad_captures_each_forward_at_its_call(monkeypatch):
    """Under no_grad a new signature needs no backward: each layer's forward is captured at its call. A later
    training call reuses the first layer's graph (its input's signature is the same) and captures its backward at
    first use; the other layers' inputs now require grad, a signature of their own, captured at their calls."""
    layers = _stack()
    graphed = capture_layers_with(EagerRecorder(), list(layers), (_x(0), _params([10, 0, 20, 5])))
    order = _log_captures(monkeypatch, graphed)
    q = _params([6, 6, 6], pad=2)
    with torch.no_grad():
        y = graphed[0](_x(3), q)
        assert order == [("fwd", 0)]
        y = _run_stack(graphed[1:], y, q)
    assert order == [("fwd", 0), ("fwd", 1), ("fwd", 2)]
    layers.zero_grad(set_to_none=True)
    x = _x(4)
    out = _run_stack(graphed, x, q)
    assert order[3:] == [("fwd", 1), ("fwd", 2)]
    out.pow(2).sum().backward()
    assert order[5:] == [("bwd", 2), ("bwd", 1), ("bwd", 0)]
    _assert_stack_matches_eager(layers, out, x, q, 4)


def test_recapture_falls_back_to_each_layer_when_the_layers_saw_different_signatures(monkeypatch):
    """A stack whose layers do not share a history (one called alone with another signature) is not captured
    whole: a signature new to the first layer may not be new to the others. Each layer captures at its call."""
    layers = _stack()
    graphed = capture_layers_with(EagerRecorder(), list(layers), (_x(0), _params([10, 0, 20, 5])))
    graphed[1](_x(1), _params([30, 2], capacity=4)).sum().backward()  # layer 1 alone: a signature of its own
    order = _log_captures(monkeypatch, graphed)
    q = _params([6, 6, 6], pad=2)
    layers.zero_grad(set_to_none=True)
    x = _x(3)
    out = _run_stack(graphed, x, q)
    assert order == [("fwd", 0), ("fwd", 1), ("fwd", 2)]
    out.pow(2).sum().backward()
    assert order[3:] == [("bwd", 2), ("bwd", 1), ("bwd", 0)]
    _assert_stack_matches_eager(layers, out, x, q, 3)


@pytest.mark.parametrize("whole", [True, False], ids=["whole-stack", "layer-by-layer"])
def test_recapture_keeps_held_outputs_of_another_signature(monkeypatch, whole):
    """Outputs the caller still holds (all hidden states of a no-grad pass, views of the layers' shared output
    buffers) keep their values when a training call captures a new signature. A whole-stack capture replays its
    forwards (real values for the next layer's warm-up) into those buffers, so it moves held outputs off them
    first, as a forward replay does. The recorder writes nothing at capture, as CUDA, so only a replay that came
    before the move could change them; and the step is still eager's."""
    if not whole:
        monkeypatch.setattr(GraphedCallable, "_stack_to_recapture", lambda self: None)
    layers = _stack()
    p = _params([10, 0, 20, 5])
    recorder = CaptureLikeRecorder()
    graphed = capture_layers_with(recorder, list(layers), (_x(0), p))
    with torch.no_grad():
        hidden = [_x(1, requires_grad=False)]
        for g in graphed:
            hidden.append(g(hidden[-1], p))
    assert all(
        h.data_ptr() == e.fwd.static_outputs[0].data_ptr()
        for h, e in zip(hidden[1:], [g.cache.values()[-1] for g in graphed], strict=True)
    )
    held = [h.clone() for h in hidden[1:]]
    q = _params([6, 6, 6], pad=2)  # a new signature for a training call
    x = _x(2)
    out = _run_stack(graphed, x, q)
    out.pow(2).sum().backward()
    assert [g.recaptures for g in graphed] == [2, 2, 2] and recorder.skipped_writes > 0
    for h, want in zip(hidden[1:], held, strict=True):
        torch.testing.assert_close(h, want, rtol=0, atol=0)
    _assert_stack_matches_eager(layers, out, x, q, 2)


def test_backward_captured_at_first_use_ignores_refilled_static_buffers():
    """The backward of a call-time capture runs autograd over the graph recorded at forward capture. Refilling the
    static buffers for the replay must not trip autograd's in-place check (a recorder that, like CUDA, does not
    re-run anything at replay); a real in-place change of a saved weight gets a clear error instead."""
    block = _model()
    graphed = capture_with(NullRecorder(), block, (_x(0), _params([10, 20])))
    out = graphed(_x(1), _params([30, 4], pad=2))  # a new signature: forward captured now, backward at first use
    out.sum().backward()
    assert all(e.bwd is not None for e in graphed.cache.values())
    out = graphed(_x(2), _params([7, 7, 7], capacity=16))
    with torch.no_grad():
        block.attn.proj.weight.add_(1.0)  # an optimizer step before the first backward
    with pytest.raises(RuntimeError, match="changed in place since its forward"):
        out.sum().backward()
    del out  # its backward was refused: the graph stays pending while its output lives
    out = graphed(_x(3), _params([30, 4], pad=2))  # a captured backward reads the weights as they are at replay
    with torch.no_grad():
        block.attn.proj.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="changed in place since its forward"):
        out.sum().backward()


def test_capture_layers_copies_only_what_changed():
    layers = _stack()
    p = _params([10, 20])
    graphed = capture_layers_with(NullRecorder(), list(layers), (_x(0), p))
    x = _x(1)
    with CopyCounter() as counter:
        out = _run_stack(graphed, x, p)
        out.sum().backward()
    # x into layer 0, cu_seqlens (q and kv share one tensor) into each layer, the loss grad into the last layer
    assert counter.copies == 1 + 3 + 1
    first = graphed[0].cache.values()[0]
    # Tensors still held across the forward (the output, x.grad, .grad) would be copied off the graph's memory.
    del out, x
    layers.zero_grad(set_to_none=True)
    with CopyCounter() as counter:
        graphed[0](first.static_inputs[0], p)  # already in the static buffer: only cu_seqlens is copied
    assert counter.copies == 1


def test_foreign_input_to_a_chained_layer_gets_its_own_graph(caplog):
    layers = _stack(2)
    p = _params([10, 20])
    graphed = capture_layers_with(EagerRecorder(), list(layers), (_x(0), p))
    x = _x(1)
    h = graphed[0](x, p)
    kept = h.detach().clone()
    with caplog.at_level(logging.WARNING, logger="packgraph.graphs"):
        out = graphed[1](h * 0.5, p)  # not layer 0's output: must not be written over it
    assert any("chain=False" in r.getMessage() for r in caplog.records)
    assert torch.equal(h, kept)
    assert graphed[1].captures == 2
    out.sum().backward()
    layers.zero_grad(set_to_none=True)
    xr = _x(1)
    ref = layers[1](layers[0](xr, p) * 0.5, p)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, xr.grad)


def test_chained_stack_recaptures_a_new_signature_still_chained(caplog):
    layers = _stack(3)
    graphed = capture_layers_with(EagerRecorder(), list(layers), (_x(0), _params([10, 20])))
    q = _params([10, 20, 1], capacity=16)  # another capacity: every layer needs a new graph
    with caplog.at_level(logging.WARNING, logger="packgraph.graphs"):
        x = _x(1)
        out = _run_stack(graphed, x, q)
        out.sum().backward()
    assert not any("chain=False" in r.getMessage() for r in caplog.records)
    assert [g.captures for g in graphed] == [2, 2, 2]
    new = [g.cache.get(g.signatures[-1]) for g in graphed]
    for prev, nxt in zip(new, new[1:], strict=False):
        assert nxt.chained and nxt.static_inputs[0].data_ptr() == prev.fwd.static_outputs[0].data_ptr()
    layers.zero_grad(set_to_none=True)
    xr = _x(1)
    ref = _run_stack(layers, xr, q)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, xr.grad)


def test_unchained_layers_each_copy_their_input():
    layers = _stack(2)
    p = _params([10, 20])
    graphed = capture_layers_with(EagerRecorder(), list(layers), (_x(0), p), chain=False)
    entries = [g.cache.values()[0] for g in graphed]
    assert entries[1].static_inputs[0].data_ptr() != entries[0].fwd.static_outputs[0].data_ptr()
    x = _x(1)
    out = graphed[1](graphed[0](x, p) + 1.0, p)
    torch.testing.assert_close(out, layers[1](layers[0](_x(1), p) + 1.0, p))
    assert [g.captures for g in graphed] == [1, 1]


def test_capture_layers_needs_single_tensor_outputs():
    def two(x):
        return x, x

    with pytest.raises(ValueError, match="must return one tensor"):
        capture_layers_with(EagerRecorder(), [two, two], (_x(0),))


# ------------------------------------------------------------------------------------------------ misc
@pytest.mark.parametrize("input_grad", [True, False])
def test_a_forward_while_its_backward_is_pending_raises(input_grad):
    """A second forward of the same graph would overwrite what the first one's pending backward reads: it raises,
    with grad enabled or under no_grad, and the pending backward stays right."""
    block = _model()
    p = _params([10, 20])
    graphed = capture_with(EagerRecorder(), block, (_x(0, requires_grad=input_grad), p))
    x1 = _x(1, requires_grad=input_grad)
    first = graphed(x1, p)
    with pytest.raises(GraphOrderError, match="backward of its previous replay is still pending"):
        graphed(_x(2, requires_grad=input_grad), p)
    with torch.no_grad(), pytest.raises(GraphOrderError, match="still pending"):
        graphed(_x(3, requires_grad=input_grad), p)
    block.zero_grad(set_to_none=True)
    _weighted_sum(first).backward()  # the refused calls left the pending backward intact
    got = [q.grad.clone() for q in block.parameters()]
    x1_grad = x1.grad.clone() if input_grad else None
    ref = _eager_grads(block, x1, p)
    torch.testing.assert_close(first.detach(), ref[0])
    if input_grad:
        torch.testing.assert_close(x1_grad, ref[1])
    for g, r in zip(got, ref[2], strict=True):
        torch.testing.assert_close(g, r)
    del first
    graphed(_x(2, requires_grad=input_grad), p)  # the first one's graph is gone: nothing pending
    with torch.no_grad():
        graphed(_x(3, requires_grad=input_grad), p)


def test_replay_that_would_overwrite_an_unfinished_forward_raises():
    """Signatures share activation memory: a forward of B while A's backward is pending could overwrite A's saved
    activations, so it raises; once A's graph is dropped (its backward can no longer run) B replays."""
    block = _model()
    pa, pb = _params([10, 20]), _params([30, 4], pad=2)
    graphed = capture_with(EagerRecorder(), block, (_x(0), pa))
    for p in (pa, pb):  # B is captured after A's backward: it may reuse A's activation memory
        _weighted_sum(graphed(_x(1), p)).backward()
    out_a = graphed(_x(2), pa)
    with pytest.raises(GraphOrderError, match="backward has not"):
        graphed(_x(3), pb)
    with torch.no_grad():
        with pytest.raises(GraphOrderError):
            graphed(_x(3), pb)  # a no-grad replay overwrites just the same
    del out_a
    got = _graphed_grads(block, graphed, _x(3), pb)
    _assert_same(got, _eager_grads(block, _x(3), pb))


def test_without_shared_activations_nested_forwards_of_two_signatures_work():
    block = _model()
    pa, pb = _params([10, 20]), _params([30, 4], pad=2)
    graphed = capture_with(EagerRecorder(), block, (_x(0), pa), share_activations=False)
    _weighted_sum(graphed(_x(1), pb)).backward()  # B captured (its backward at first use)
    block.zero_grad(set_to_none=True)
    xa, xb = _x(2), _x(3)
    out_a = graphed(xa, pa)
    out_b = graphed(xb, pb)
    _weighted_sum(out_b).backward()
    _weighted_sum(out_a).backward()
    got = [w.grad.clone() for w in block.parameters()]
    block.zero_grad(set_to_none=True)
    xa2, xb2 = _x(2), _x(3)
    (_weighted_sum(block(xa2, pa)) + _weighted_sum(block(xb2, pb))).backward()
    for g, r in zip(got, [w.grad for w in block.parameters()], strict=True):
        torch.testing.assert_close(g, r)
    torch.testing.assert_close(xa.grad, xa2.grad)
    torch.testing.assert_close(xb.grad, xb2.grad)


def test_without_cuda_capture_raises(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="packgraph.capture needs a CUDA device"):
        graphs.capture(nn.Linear(2, 2), (torch.randn(3, 2),))
    with pytest.raises(RuntimeError, match="packgraph.capture_layers needs a CUDA device"):
        graphs.capture_layers([nn.Linear(2, 2)], (torch.randn(3, 2),))


def test_host_work_per_replayed_layer_is_bounded():
    """Engine host work per layer call (forward + backward) with graph replays made free, counted as Python-level
    calls (deterministic, unlike a timing on a shared CI machine): catches a per-call signature rebuild or a loop
    over the whole model creeping into the replay path. The per-parameter work (one autograd edge, one storage
    check and one grad hook per parameter) is part of the count."""
    import sys

    torch.manual_seed(0)
    cfg = GPTConfig(d_model=D, n_head=4, n_layer=12, vocab_size=50)
    layers = [Block(cfg) for _ in range(12)]
    p = PackedSeqParams.from_seqlens([10, 20, 5], capacity=8, total_tokens=T, max_seqlen=T)
    x = torch.randn(T, D, requires_grad=True)
    graphed = capture_layers_with(NullRecorder(), layers, (x, p))

    def step():
        h = x * 1.0
        for g in graphed:
            h = g(h, p)
        h.sum().backward()

    for _ in range(3):
        step()
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        for _ in range(4):
            step()
    finally:
        sys.setprofile(None)
    per_layer = calls / 4 / 12
    t0 = time.perf_counter()
    step()
    us = (time.perf_counter() - t0) / 12 * 1e6
    print(f"\nengine host work per replayed layer: {per_layer:.0f} Python calls, {us:.0f} us")
    assert per_layer < 340


def test_varlen_attention_is_what_the_graph_sees():
    """The callable receives an ordinary PackedSeqParams rebuilt on static buffers, with the captured statics."""
    seen = []

    def attn(x, params):
        seen.append(params)
        q = x.view(T, 4, D // 4)
        return varlen_attention(q, q, q, params).reshape(T, D)

    p = _params([10, 20])
    graphed = capture_with(EagerRecorder(), attn, (_x(0), p))
    q = _params([30, 2, 1])
    torch.testing.assert_close(graphed(_x(1), q), attn(_x(1), q))
    inside = seen[-2]  # the last replay (the call after it is the eager reference)
    assert isinstance(inside, PackedSeqParams) and inside.host_offsets is None
    assert inside.max_seqlen_q == T and inside.total_tokens is None
    assert inside.cu_seqlens_kv is inside.cu_seqlens_q
    assert inside.cu_seqlens_q.tolist() == q.cu_seqlens_q.tolist()


def test_unhashable_static_arguments_are_flagged(caplog):
    lin = nn.Linear(D, D).double()

    def fn(x, options):
        return lin(x) * len(options)

    with caplog.at_level(logging.WARNING, logger="packgraph.graphs"):
        graphed = capture_with(EagerRecorder(), fn, (_x(0), {"a", "b"}))
    assert any("args[1] (set) is compared by identity" in r.getMessage() for r in caplog.records)
    graphed(_x(1), {"a", "b"})  # an equal but new object: a new signature
    assert graphed.captures == 2


@pytest.mark.parametrize("derive", ["view", "reshape", "clone", "double_transpose"])
def test_input_grads_through_a_view_of_a_leaf_accumulate_as_eager(derive):
    """A leaf reaching the graph through a view (or any non-leaf) must not end up holding the static grad buffer:
    the next replay would overwrite its .grad, and a second micro-batch would add the buffer to itself."""
    make = {
        "view": lambda a: a.view(2, 4),
        "reshape": lambda a: a.reshape(2, 4),
        "clone": lambda a: a.view(2, 4).clone(),
        "double_transpose": lambda a: a.view(2, 4).t().t(),
    }[derive]
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).double()
    ref = nn.Linear(4, 4).double()
    ref.load_state_dict(lin.state_dict())
    graphed = capture_with(EagerRecorder(), lin, (torch.randn(2, 4, dtype=torch.float64, requires_grad=True),))
    lin.zero_grad(set_to_none=True)
    a = torch.randn(8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(8, dtype=torch.float64, requires_grad=True)
    a_ref, b_ref = (t.detach().clone().requires_grad_() for t in (a, b))
    for scale in (1.0, 3.0):
        (scale * graphed(make(a)).sum()).backward()
        (scale * ref(make(a_ref)).sum()).backward()
    grad_after_a = a.grad.clone()
    (graphed(make(b)) * 2).sum().backward()  # another backward of the same graph must leave a.grad alone
    (ref(make(b_ref)) * 2).sum().backward()
    torch.testing.assert_close(a.grad, a_ref.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(a.grad, grad_after_a, rtol=0, atol=0)
    torch.testing.assert_close(b.grad, b_ref.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=0, atol=1e-12)


def test_a_submodule_switched_to_eval_alone_is_a_new_signature():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(D, D), nn.Dropout(0.5)).double()
    graphed = capture_with(EagerRecorder(), block, (torch.randn(4, D, dtype=torch.float64),), on_mismatch="error")
    x = torch.randn(4, D, dtype=torch.float64)
    graphed(x)
    block[1].eval()  # the top module still says training=True
    with pytest.raises(GraphSignatureError, match="module.training"):
        graphed(x)
    block[1].train()
    graphed(x)
