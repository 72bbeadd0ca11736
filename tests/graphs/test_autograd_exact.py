"""Eager autograd is the spec: each case compares a graphed callable with the eager module on the same inputs.

The engine runs on the CPU stand-in recorder (``tests/eager_recorder.py``): replays re-run the recorded body and
write the results into the static tensors, which is a CUDA graph's memory contract. The same cases run on the GPU
in ``tests/cuda/test_autograd_exact_cuda.py``.
"""

import random

import pytest
import torch
from torch import nn

from packgraph.buckets import default_buckets
from packgraph.graphs.capture import capture_layers_with, capture_with
from packgraph.models.gpt import Block, GPTConfig
from packgraph.ops import varlen_attention
from packgraph.params import PackedSeqParams
from tests.eager_recorder import EagerRecorder

T, D = 48, 32
# How held handed-out memory is kept (tests/graphs/conftest.py): small outputs as copies, or every output on a
# handle settled by _swap_data_ptr_, or by moving its holders one by one (a torch without it).
HANDOUT_PATHS = pytest.mark.parametrize("handout_path", ["copy", "swap", "scan"], indirect=True)


def _block(seed=0):
    torch.manual_seed(seed)
    return Block(GPTConfig(d_model=D, n_head=4, n_layer=2, vocab_size=50)).double()


def _params(lengths, capacity=8):
    return PackedSeqParams.from_seqlens(lengths, capacity=capacity, total_tokens=T, max_seqlen=T)


def _x(seed, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, D, dtype=torch.float64, generator=g).requires_grad_(requires_grad)


def _loss(out):
    return (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()


def _grads(module):
    return {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


def _same_grads(a, b):
    assert a.keys() == b.keys()
    for n in a:
        assert (a[n] is None) == (b[n] is None), n
        if a[n] is not None:
            torch.testing.assert_close(a[n], b[n], msg=n)


# ------------------------------------------------------------------------------------------------ 1: autograd.grad
def test_autograd_grad_wrt_the_input_leaves_param_grads_alone():
    block = _block()
    p = _params([10, 20, 5])
    graphed = capture_with(EagerRecorder(), block, (_x(0), p))
    for fn in (block, graphed):
        block.zero_grad(set_to_none=True)
        x = _x(1)
        (gx,) = torch.autograd.grad(_loss(fn(x, p)), [x])
        assert all(q.grad is None for q in block.parameters())  # eager leaves every .grad as it was
        if fn is block:
            want = gx
    torch.testing.assert_close(gx, want)
    # With grads already there, they stay exactly as they were.
    _loss(block(_x(2), p)).backward()
    before = _grads(block)
    x = _x(3)
    torch.autograd.grad(_loss(graphed(x, p)), [x])
    _same_grads(_grads(block), before)


def test_backward_with_inputs_accumulates_only_those():
    block = _block()
    p = _params([10, 20, 5])
    graphed = capture_with(EagerRecorder(), block, (_x(0), p))
    target = block.attn.qkv.weight
    results = []
    for fn in (block, graphed):
        block.zero_grad(set_to_none=True)
        x = _x(1)
        _loss(fn(x, p)).backward(inputs=[x, target])
        results.append((x.grad.clone(), _grads(block)))
    (gx_e, ge), (gx_g, gg) = results
    torch.testing.assert_close(gx_g, gx_e)
    _same_grads(gg, ge)
    assert ge["attn.qkv.weight"] is not None and ge["mlp.down.weight"] is None


def test_autograd_grad_of_params_returns_them_and_keeps_them_across_replays():
    block = _block()
    p = _params([10, 20, 5])
    graphed = capture_with(EagerRecorder(), block, (_x(0), p))
    params = list(block.parameters())
    held = torch.autograd.grad(_loss(graphed(_x(1), p)), params)  # views of the graph's grads, handed out
    kept = [g.clone() for g in held]
    torch.autograd.grad(_loss(graphed(_x(2), p)), params)  # the next replay rewrites the graph's grads
    for g, k in zip(held, kept, strict=True):
        torch.testing.assert_close(g, k, rtol=0, atol=0)  # the first results are what eager would still hold
    want = torch.autograd.grad(_loss(block(_x(1), p)), params)
    for g, w in zip(held, want, strict=True):
        torch.testing.assert_close(g, w)


# ------------------------------------------------------------------------------------------------ 2: frozen params
def test_parameters_frozen_and_unfrozen_after_capture():
    block = _block()
    p = _params([10, 20, 5])
    graphed = capture_with(EagerRecorder(), block, (_x(0), p))
    for frozen in (["attn.qkv.weight"], ["attn.qkv.weight", "mlp.gate_up.weight"], []):
        for name, q in block.named_parameters():
            q.requires_grad_(name not in frozen)
        got = []
        for fn in (block, graphed):
            block.zero_grad(set_to_none=True)
            _loss(fn(_x(4), p)).backward()
            got.append(_grads(block))
        _same_grads(got[1], got[0])
        for name in frozen:
            assert got[1][name] is None
    assert graphed.captures == 3  # one graph per set of trained parameters; unfreezing all reuses the first
    assert graphed.num_graphs == 3


def test_a_chained_stack_head_frozen_for_a_step_then_unfrozen_trains_as_eager():
    """Freezing a parameter of the stack's first layer changes its signature only, so the stack is captured again
    and the later layers' graphs of that signature replaced. The head's graph of the unfrozen signature ran with the
    replaced ones; replayed beside the new ones (captured in the pool after its activations went back to it), it
    would be overwritten by them: once unfrozen, the stack trains as eager does, with one micro-batch or two
    (found by a random schedule: this raised GraphOrderError at the first step after unfreezing)."""
    policy = default_buckets(T)
    layers = [_block(seed) for seed in range(3)]
    graphed = capture_layers_with(EagerRecorder(), layers, (_x(0), _params([12, 3])), buckets=policy)
    head = layers[0].mlp.down.weight

    def step(stack, seed, batches):
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        outs = []
        for k, lengths in enumerate(batches):
            h = _x(seed + k)
            for layer in stack:
                h = layer(h, _params(lengths))
            _loss(h).backward()
            outs.append(h.detach().clone())
        return outs, [_grads(layer) for layer in layers]

    schedule = [(1, False, [[12, 3]]), (2, True, [[12, 3]]), (3, False, [[12, 3]]),
                (4, False, [[12, 3], [10, 20, 5]]), (5, True, [[40]]), (6, False, [[40], [7]])]  # fmt: skip
    for seed, frozen, batches in schedule:
        head.requires_grad_(not frozen)
        got, want = step(graphed, seed, batches), step(layers, seed, batches)
        for a, b in zip(got[0], want[0], strict=True):
            torch.testing.assert_close(a, b, msg=f"step {seed}")
        for a, b in zip(got[1], want[1], strict=True):
            _same_grads(a, b)
    assert graphed[0].num_graphs < graphed[0].captures  # the head's stale graphs were dropped, not kept


# ------------------------------------------------------------------------------------------------ 3: host offsets
def test_a_reassigned_cu_seqlens_is_not_bucketed_from_stale_host_offsets():
    policy = default_buckets(2048)
    params = PackedSeqParams.from_seqlens([100, 20], capacity=8, total_tokens=2048, max_seqlen=2048)
    new = torch.tensor([0, 1000, 1020] + [1020] * 6, dtype=torch.int32)  # same length, other values
    params.cu_seqlens_q = new
    params.cu_seqlens_kv = new
    assert params.current_host_offsets() is None
    bucketed = policy.apply(params)
    assert bucketed.max_seqlen_q >= 1000  # from the params' own static bound, not the stale 100
    q = torch.randn(2048, 2, 8, dtype=torch.float64)
    ref = PackedSeqParams.from_seqlens([1000, 20], capacity=8, total_tokens=2048, max_seqlen=1000)
    torch.testing.assert_close(varlen_attention(q, q, q, bucketed), varlen_attention(q, q, q, ref))


def test_host_offsets_follow_the_tensor_objects_and_their_versions():
    params = PackedSeqParams.from_seqlens([5, 7], capacity=4, total_tokens=16)
    assert params.current_host_offsets() is not None
    assert params.to("cpu").current_host_offsets() is not None  # moved: same values, still trusted
    params.cu_seqlens_q.add_(0)  # an in-place write, even one that changes nothing
    assert params.current_host_offsets() is None
    with torch.inference_mode():
        inference = PackedSeqParams.from_seqlens([5, 7], capacity=4, total_tokens=16)
    assert inference.current_host_offsets() is None  # no version counter: never trusted


# ------------------------------------------------------------------------------------------------ 4-5: buckets
@pytest.mark.parametrize("T", [100, 2048, 4096, 8192])
def test_default_ladder_fits_every_valid_batch(T):
    policy = default_buckets(T)
    rng = random.Random(T)
    for n in (1, 2, 511, 513, 600, T // 2, T):
        if n > T:
            continue
        longest = rng.randint(0 if n > 1 else 1, T // n)
        bucket = policy.bucket_for(longest, n)
        assert bucket.capacity >= n and bucket.max_seqlen >= longest
    assert policy.bucket_for(T, 1).max_seqlen == T
    assert policy.bucket_for(1, T).capacity == T


def test_a_bucketed_cache_holds_every_bucket():
    policy = default_buckets(T)
    lin = nn.Linear(D, D).double()

    def attend(x, params):
        return varlen_attention(lin(x).view(T, 4, D // 4), x.view(T, 4, D // 4), x.view(T, 4, D // 4), params)

    rng = random.Random(0)
    graphed = capture_with(EagerRecorder(), attend, (_x(0, requires_grad=False), _params([5])), buckets=policy)
    buckets = [(s, c) for s in policy.max_seqlen_ladder for c in policy.capacity_ladder]
    for _ in range(3):
        for max_seqlen, capacity in buckets:
            n = min(capacity, T)
            lengths = [1] * n
            lengths[0] = min(max_seqlen, T - (n - 1))
            params = PackedSeqParams.from_seqlens(lengths, capacity=n, total_tokens=T, max_seqlen=T)
            with torch.no_grad():
                graphed(_x(rng.randint(0, 9), requires_grad=False), params)
    assert graphed.evictions == 0 and graphed.num_graphs == graphed.captures <= policy.num_buckets


def test_a_bucketed_cache_holds_the_whole_default_ladder_at_t2048():
    """default_buckets(2048) has 18 buckets, more than the 8 graphs an unbucketed cache keeps: cycling through all
    of them three times captures each once and evicts none."""
    policy = default_buckets(2048)
    graphed = capture_with(
        EagerRecorder(), lambda x, params: x * 2, (torch.zeros(4), _params_t([5], 2048)), buckets=policy
    )
    # one batch per (max_seqlen rung, capacity rung): n documents, the longest as close to the rung as T allows
    reachable = [
        [min(s, 2048 - (c - 1))] + [1] * (c - 1) for s in policy.max_seqlen_ladder for c in policy.capacity_ladder
    ]
    for _ in range(3):
        for lengths in reachable:
            graphed(torch.zeros(4), _params_t(lengths, 2048))
    assert graphed.evictions == 0
    assert graphed.captures == len(
        {policy.bucket_for(max(ls), len(ls)) for ls in reachable} | {policy.bucket_for(5, 1)}
    )


def _params_t(lengths, total):
    return PackedSeqParams.from_seqlens(lengths, capacity=len(lengths), total_tokens=total, max_seqlen=max(lengths))


# ------------------------------------------------------------------------------------------------ create_graph
def test_double_backward_is_refused_with_a_clear_error():
    block = _block()
    p = _params([10, 20])
    graphed = capture_with(EagerRecorder(), block, (_x(0), p))
    x = _x(1)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(_loss(graphed(x, p)), [x], create_graph=True)


# ------------------------------------------------------------------------------------------------ storage changes
def test_parameters_moved_after_capture_are_detected_and_recaptured():
    block = _block()
    p = _params([10, 20, 5])
    graphed = capture_with(EagerRecorder(), block, (_x(0), p))
    ref = _block()
    ref.load_state_dict(block.state_dict())
    # assign=True puts new tensors (new storage) in the module: the old graph would read stale weights
    fresh = {k: v.clone() * 1.5 for k, v in ref.state_dict().items()}
    block.load_state_dict(fresh, assign=True)
    ref.load_state_dict(fresh)
    for fn, module in ((graphed, block), (ref, ref)):
        module.zero_grad(set_to_none=True)
        _loss(fn(_x(2), p)).backward()
    torch.testing.assert_close(graphed(_x(3), p), ref(_x(3), p))
    _same_grads(_grads(block), _grads(ref))
    assert graphed.captures == 2
    block.float()  # module.to(dtype): new storage again
    out = graphed(_x(3).float(), p)
    torch.testing.assert_close(out, ref.float()(_x(3).float(), p))


# ------------------------------------------------------------------------------------------------ hooks
def test_gradient_hooks_fire_as_in_eager():
    block = _block()
    p = _params([10, 20, 5])
    graphed = capture_with(EagerRecorder(), block, (_x(0), p))
    results = []
    for fn in (block, graphed):
        seen = {"tensor": 0, "post": 0}

        def double(g, seen=seen):
            seen["tensor"] += 1
            return 2 * g

        def post(param, seen=seen):
            seen["post"] += 1

        handles = [block.attn.qkv.weight.register_hook(double)]
        handles += [q.register_post_accumulate_grad_hook(post) for q in block.parameters()]
        block.zero_grad(set_to_none=True)
        for i in range(2):  # two micro-batches: hooks fire for each
            _loss(fn(_x(5 + i), p)).backward()
        results.append((dict(seen), _grads(block)))
        for h in handles:
            h.remove()
    (seen_e, ge), (seen_g, gg) = results
    assert seen_g == seen_e == {"tensor": 2, "post": 2 * len(ge)}
    _same_grads(gg, ge)


# ------------------------------------------------------------------------------------------------ handed-out memory
def test_outputs_held_across_calls_keep_their_values():
    block = _block()
    p = _params([10, 20, 5])
    graphed = capture_with(EagerRecorder(), block, (_x(0), p), forward_only=True)
    with torch.no_grad():
        held = [graphed(_x(i), p) for i in range(4)]  # each call rewrites the static output
        for i, out in enumerate(held):
            torch.testing.assert_close(out, block(_x(i), p))


@HANDOUT_PATHS
def test_grads_kept_across_steps_keep_their_values(handout_path):
    block = _block()
    p = _params([10, 20, 5])
    graphed = capture_with(EagerRecorder(), block, (_x(0), p))
    history = []
    for i in range(3):
        block.zero_grad(set_to_none=True)
        _loss(graphed(_x(i), p)).backward()
        history.append(block.attn.qkv.weight.grad)  # no clone: eager keeps each step's tensor as it was
    for i, g in enumerate(history):
        block.zero_grad(set_to_none=True)
        _loss(block(_x(i), p)).backward()
        torch.testing.assert_close(g, block.attn.qkv.weight.grad)


@HANDOUT_PATHS
def test_zero_grad_without_set_to_none_and_micro_batches_match_eager(handout_path):
    block = _block()
    p = _params([10, 20, 5])
    graphed = capture_with(EagerRecorder(), block, (_x(0), p))
    got = []
    for fn in (block, graphed):
        block.zero_grad(set_to_none=True)
        for step in range(3):
            block.zero_grad(set_to_none=False)
            for mb in range(2):
                _loss(fn(_x(10 * step + mb), p)).backward()
        got.append(_grads(block))
    _same_grads(got[1], got[0])


@HANDOUT_PATHS
def test_views_and_detached_aliases_of_outputs_kept_across_calls_keep_their_values(handout_path):
    """Eager keeps every tensor a caller holds: a slice, a ``.detach()``, a view of a view, a tensor autograd saved
    from an output. Each keeps its values through later replays that rewrite the graph's memory."""
    block = _block()
    p = _params([10, 20, 5])
    for forward_only in (True, False):
        graphed = capture_with(EagerRecorder(), block, (_x(0), p), forward_only=forward_only)
        kept, want = [], []
        for i in range(1, 4):
            with torch.set_grad_enabled(not forward_only):  # a forward-only graph refuses a call eager would train
                out = graphed(_x(i), p)
            kept += [out[:4], out.detach(), out.detach()[2:].t()[1:], out.detach().view(-1)]
            want += [t.detach().clone() for t in kept[-4:]]
            squared = (out * out).sum()  # autograd saves ``out`` itself for this product's backward
            if not forward_only:
                squared.backward()  # reads the saved output after the loss: eager's values
                block.zero_grad(set_to_none=True)
        for i in range(1, 4):
            eager = block(_x(i), p).detach()
            views = [eager[:4], eager, eager[2:].t()[1:], eager.view(-1)]
            for t, w in zip(kept[4 * (i - 1) : 4 * i], views, strict=True):
                torch.testing.assert_close(t, w, rtol=0, atol=0)
        for t, w in zip(kept, want, strict=True):
            torch.testing.assert_close(t, w, rtol=0, atol=0)


class _LossOf(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, p):
        return _loss(self.block(x, p))


@HANDOUT_PATHS
def test_a_loss_detached_for_logging_before_backward_keeps_its_value(handout_path):
    """``logged = loss.detach(); loss.backward()`` on a graphed loss. A small output goes out as a copy. On a handle,
    the backward writes no memory the loss lives in, so it neither refuses the alias nor moves it; the next forward
    moves it to memory of its own first."""
    block = _block()
    p = _params([10, 20, 5])
    graphed = capture_with(EagerRecorder(), _LossOf(block), (_x(0), p))
    (entry,) = graphed.cache.values()
    static = entry.fwd.static_outputs[0]
    logged, grads = [], []
    for i in range(1, 5):
        block.zero_grad(set_to_none=True)
        loss = graphed(_x(i), p)
        logged.append(loss.detach())
        assert (loss.data_ptr() == static.data_ptr()) == (handout_path != "copy")
        loss.backward()
        assert loss.data_ptr() == logged[-1].data_ptr()  # not moved by the backward
        grads.append(_grads(block))
    for i in range(1, 5):
        block.zero_grad(set_to_none=True)
        loss = _loss(block(_x(i), p))
        loss.backward()
        torch.testing.assert_close(logged[i - 1], loss.detach(), rtol=0, atol=0)
        _same_grads(grads[i - 1], _grads(block))


def test_layers_chained_in_a_stack_match_eager_over_steps_and_buckets():
    policy = default_buckets(T)
    layers = nn.ModuleList(_block(seed) for seed in range(3))
    graphed = capture_layers_with(EagerRecorder(), list(layers), (_x(0), _params([12, 3])), buckets=policy)
    rng = random.Random(3)
    for step in range(6):
        lengths = [rng.randint(1, 5) for _ in range(rng.choice([1, 3, 9]))]
        params = PackedSeqParams.from_seqlens(lengths, capacity=len(lengths), total_tokens=T, max_seqlen=T)
        results = []
        for stack in (layers, graphed):
            layers.zero_grad(set_to_none=True)
            x = _x(step)
            h = x
            for layer in stack:
                h = layer(h, params)
            _loss(h).backward()
            results.append((h.detach().clone(), x.grad.clone(), _grads(layers)))
        torch.testing.assert_close(results[1][0], results[0][0])
        torch.testing.assert_close(results[1][1], results[0][1])
        _same_grads(results[1][2], results[0][2])
    assert graphed[0].num_graphs >= 2  # several buckets met
    assert all(g.evictions == 0 for g in graphed)
    for g in graphed:  # one set of outputs per layer, whatever the number of buckets
        first, *later = g.cache.values()
        for entry in later:
            assert all(a is b for a, b in zip(entry.fwd.static_outputs, first.fwd.static_outputs, strict=True))
    # Each bucket's grads are its own, released to the pool once idle: every capture after the first found the
    # earlier buckets' grads unheld (zero_grad set them to None) and released them, and the stand-in then wrote
    # NaNs over them at every later capture and replay, which the equalities above would have caught.
    recorder = graphed[0].group.recorder
    assert recorder.released and recorder.poisonings > 0
    held = [r for g in graphed for e in list(g.cache.values())[:-1] for r in e.bwd.grad_records if r is not None]
    assert held and all(r.released_at is not None for r in held)


def test_use_recorder_drives_capture_without_cuda():
    block = _block()
    p = _params([10, 20])
    import packgraph
    from packgraph.graphs import use_recorder

    with use_recorder(EagerRecorder()):
        graphed = packgraph.capture(block, (_x(0), p))
    torch.testing.assert_close(graphed(_x(1), p), block(_x(1), p))
