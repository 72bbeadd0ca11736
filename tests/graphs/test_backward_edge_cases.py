"""``backward(retain_graph=True)`` through graphed calls, against eager.

Eager runs a retained graph's backward again whenever the caller asks. A graphed call's backward reads activations
and buffers in graph memory, which a later replay or capture may overwrite: then a second backward raises an error
that names the case, and where nothing overwrote them (``share_activations=False``) it gives eager's grads. Found
by a random schedule (a second backward after another call gave wrong grads, silently) and by the H200 (with shared
activations, a second backward read memory its first had reused)."""

import copy

import pytest
import torch

from packgraph.graphs.capture import capture_layers_with, capture_with
from tests.eager_recorder import EagerRecorder, OpReplayRecorder
from tests.graphs.test_autograd_exact import _block, _grads, _loss, _params, _same_grads, _x

RECORDERS = pytest.mark.parametrize("recorder", [EagerRecorder, OpReplayRecorder])
P_A, P_B = ([10, 20, 5], 8), ([30, 4], 16)


def _twice(fn, module, between=None):
    """x.grad and the parameters' grads after ``backward(retain_graph=True)``, ``between()``, ``backward()``."""
    module.zero_grad(set_to_none=True)
    x = _x(1)
    loss = _loss(fn(x, _params(*P_A)))
    loss.backward(retain_graph=True)
    if between is not None:
        between(fn)
    loss.backward()
    return x.grad.clone(), _grads(module)


@RECORDERS
def test_a_second_backward_with_nothing_between_gives_eager_grads(recorder):
    """Where each graph keeps its activations (``share_activations=False``)."""
    block = _block()
    eager = copy.deepcopy(block)
    graphed = capture_with(recorder(), block, (_x(0), _params(*P_A)), share_activations=False)
    gx, grads = _twice(graphed, block)
    ex, eager_grads = _twice(eager, eager)
    torch.testing.assert_close(gx, ex)
    _same_grads(grads, eager_grads)


@RECORDERS
def test_a_second_backward_sharing_activations_is_refused_even_with_nothing_between(recorder):
    """A backward graph recorded without retain_graph reuses, later in the same graph, the memory of activations it
    has read: under CUDA its second replay read NaNs. The stand-ins keep them, and must refuse all the same."""
    block = _block()
    graphed = capture_with(recorder(), block, (_x(0), _params(*P_A)))
    with pytest.raises(RuntimeError, match="its first backward.*share_activations=False"):
        _twice(graphed, block)


def _no_grad_same(fn):
    with torch.no_grad():
        fn(_x(2), _params(*P_A))


def _no_grad_other(fn):
    with torch.no_grad():
        fn(_x(2), _params(*P_B))


def _training_step(fn):
    x = _x(2)
    _loss(fn(x, _params(*P_B))).backward(inputs=[x])


def _training_step_same(fn):
    x = _x(2)
    _loss(fn(x, _params(*P_A))).backward(inputs=[x])


@RECORDERS
@pytest.mark.parametrize("between", [_no_grad_same, _training_step_same])
def test_a_second_backward_after_a_call_of_its_own_graph_is_refused(recorder, between):
    block = _block()
    graphed = capture_with(recorder(), block, (_x(0), _params(*P_A)), share_activations=False)
    with pytest.raises(RuntimeError, match="second backward through this call's autograd graph"):
        _twice(graphed, block, between)
    eager = _block()
    _twice(eager, eager, between)  # eager runs it: the refusal is the engine's, and says so


@RECORDERS
@pytest.mark.parametrize("between", [_no_grad_other, _training_step])
def test_a_second_backward_after_a_call_of_another_signature_gives_eager_grads(recorder, between):
    """Each graph keeps its activations, and the other signature's graphs write none of this one's memory."""
    block = _block()
    eager = copy.deepcopy(block)
    graphed = capture_with(recorder(), block, (_x(0), _params(*P_A)), share_activations=False)
    gx, grads = _twice(graphed, block, between)
    ex, eager_grads = _twice(eager, eager, between)
    torch.testing.assert_close(gx, ex)
    _same_grads(grads, eager_grads)


def _stack(share_activations):
    layers = [_block(seed) for seed in range(3)]
    eager = copy.deepcopy(layers)
    stack = capture_layers_with(OpReplayRecorder(), layers, (_x(0), _params(*P_A)), share_activations=share_activations)
    return layers, eager, stack


def _run(stack):
    def fn(x, params):
        for layer in stack:
            x = layer(x, params)
        return x

    return fn


def test_a_stack_keeping_its_activations_runs_a_second_backward_as_eager():
    layers, eager, stack = _stack(share_activations=False)
    holder, eager_holder = torch.nn.ModuleList(layers), torch.nn.ModuleList(eager)
    gx, grads = _twice(_run(stack), holder)
    ex, eager_grads = _twice(_run(eager), eager_holder)
    torch.testing.assert_close(gx, ex)
    _same_grads(grads, eager_grads)


def test_a_stack_sharing_activations_refuses_a_second_backward():
    """Each layer's backward may overwrite the later layers' activations, which went back to the pool."""
    layers, _, stack = _stack(share_activations=True)
    with pytest.raises(RuntimeError, match="share_activations=False"):
        _twice(_run(stack), torch.nn.ModuleList(layers))


def forward_keeping_hidden_grads(stack, x, p, kept=None):
    """The stack's output; with ``kept``, a tensor hook appends the grad of each hidden state between layers."""
    for k, layer in enumerate(stack):
        x = layer(x, p)
        if kept is not None and k + 1 < len(stack):
            x.register_hook(kept.append)
    return x


@RECORDERS
def test_a_hidden_state_grad_kept_by_a_hook_keeps_its_values(recorder):
    """A stack's layer recaptured alone (a forward hook added) writes the other chained grad buffer than the one its
    producer's older graph reads in place: that grad is copied into the buffer, and a grad a tensor hook kept on it
    moves first. Found by a random schedule (the kept grad became the previous layer's)."""
    from packgraph.buckets import BucketPolicy
    from packgraph.graphs import GraphOrderError
    from packgraph.params import PackedSeqParams

    def params(lengths, capacity, max_seqlen):
        return PackedSeqParams.from_seqlens(lengths, capacity=capacity, total_tokens=48, max_seqlen=max_seqlen)

    layers = [_block(seed) for seed in range(3)]
    eager = copy.deepcopy(layers)
    policy = BucketPolicy((16, 48), (4, 12, 48))
    graphed = capture_layers_with(recorder(), layers, (_x(0), params([12, 3], 8, 48)), buckets=policy)
    results = []
    for stack, modules in ((graphed, layers), (eager, eager)):
        pending = forward_keeping_hidden_grads(stack, _x(9), params([30, 4], 2, 30))
        try:
            with torch.no_grad():
                forward_keeping_hidden_grads(stack, _x(5009, requires_grad=False), params([12, 3], 2, 12))
        except GraphOrderError:
            assert stack is graphed  # the engine's named refusal; eager runs it
        del pending
        _loss(forward_keeping_hidden_grads(stack, _x(10, requires_grad=False), params([5], 1, 5))).backward()
        modules[1].register_forward_hook(lambda m, a, o: o * 0.5)
        kept = []
        out = forward_keeping_hidden_grads(stack, _x(20, requires_grad=False), params([5], 2, 48), kept)
        _loss(out).backward()
        results.append((out.detach(), kept, [_grads(m) for m in modules]))
    (out, kept, grads), (eager_out, eager_kept, eager_grads) = results
    torch.testing.assert_close(out, eager_out)
    assert len(kept) == len(eager_kept) == 2
    for a, b in zip(kept, eager_kept, strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(grads, eager_grads, strict=True):
        _same_grads(a, b)


@RECORDERS
def test_a_forward_only_callable_refuses_a_call_whose_eager_output_requires_grad(recorder):
    """Eager's output would require grad and carry it to the input; a forward-only graph has no backward. Found by
    a random schedule (the graph's output silently did not require grad)."""
    block = _block()
    scorer = capture_with(recorder(), block, (_x(0, requires_grad=False), _params(*P_A)), forward_only=True)
    with pytest.raises(RuntimeError, match="forward_only=True"):
        scorer(_x(1), _params(*P_A))
    with torch.no_grad():
        out = scorer(_x(1), _params(*P_A))
        torch.testing.assert_close(out, block(_x(1), _params(*P_A)))


@RECORDERS
def test_a_signature_met_first_without_grad_trains_after_an_optimizer_step(recorder):
    """Evaluation meets a bucket first (its forward is captured, its backward waits for the first backward), the
    optimizer steps, then training meets it: eager's grads, at that step and the next. Found by a random schedule
    (the late backward capture refused the step, and every later one, on the parameters' version counters)."""
    block = _block()
    eager = copy.deepcopy(block)
    graphed = capture_with(recorder(), block, (_x(0), _params(*P_A)))
    results = []
    for fn, module in ((graphed, block), (eager, eager)):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        with torch.no_grad():
            fn(_x(1, requires_grad=False), _params(*P_B))
        _loss(fn(_x(2, requires_grad=False), _params(*P_A))).backward()
        optimizer.step()
        steps = []
        for seed in (3, 4):
            module.zero_grad(set_to_none=True)
            _loss(fn(_x(seed, requires_grad=False), _params(*P_B))).backward()
            steps.append(_grads(module))
            optimizer.step()
        results.append(steps)
    for a, b in zip(*results, strict=True):
        _same_grads(a, b)


class _Scaled(torch.nn.Module):
    """A linear map times a buffer, which autograd saves for the backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8).double()
        self.register_buffer("scale", torch.rand(8, dtype=torch.float64))

    def forward(self, x):
        return self.lin(x) * self.scale


@pytest.mark.parametrize("recorder", [OpReplayRecorder])  # the eager stand-in re-runs: its late capture succeeds
def test_a_signature_whose_late_backward_capture_failed_is_captured_again(recorder):
    """A buffer written in place between a signature's forward capture (a no-grad call met it) and its first
    backward: that backward cannot be captured (named error), and the signature's next call captures anew and
    trains as eager. Found by a random schedule (every later call failed)."""
    module = _Scaled()
    eager = copy.deepcopy(module)
    graphed = capture_with(recorder(), module, (torch.randn(4, 8, dtype=torch.float64, requires_grad=True),))
    x = torch.randn(6, 8, dtype=torch.float64)
    with torch.no_grad():
        graphed(x.clone().requires_grad_())  # the signature the training calls have
        module.scale.mul_(2)
        eager.scale.mul_(2)
    with pytest.raises(RuntimeError, match="captured at its first backward"):
        graphed(x.clone().requires_grad_()).sum().backward()
    assert graphed.num_graphs == 1  # the failed signature's graphs were dropped
    module.zero_grad(set_to_none=True)
    xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    _loss(graphed(xg)).backward()
    _loss(eager(xe)).backward()
    torch.testing.assert_close(xg.grad, xe.grad)
    _same_grads(_grads(module), _grads(eager))


@RECORDERS
def test_a_retained_stack_refuses_a_second_backward_after_a_forward_wrote_its_inputs(recorder):
    """Layers captured one by one at call time have pools of their own; a later layer still reads the earlier
    layer's output in place, which the earlier layer's next forward writes. Found by a random schedule (the second
    backward read the new inputs)."""
    layers = [_block(seed) for seed in range(3)]
    stack = capture_layers_with(recorder(), layers, (_x(0), _params(*P_A)), share_activations=False)
    run = _run(stack)
    with torch.no_grad():
        run(_x(1, requires_grad=False), _params(*P_A))  # new signatures for every layer, captured one by one
    loss = _loss(run(_x(2, requires_grad=False), _params(*P_A)))  # layer 0's replays, the others' are new again
    loss.backward(retain_graph=True)
    with torch.no_grad():
        run(_x(3, requires_grad=False), _params(*P_A))  # layer 0 writes the output layer 1's retained graph reads
    with pytest.raises(RuntimeError, match="second backward through this call's autograd graph"):
        loss.backward()


@RECORDERS
def test_a_second_backward_after_its_graph_was_evicted_is_refused(recorder):
    """With one graph allowed, a call of another signature evicts the retained call's graph, whose memory goes back
    to the pool: its second backward raises, naming the eviction (eager would run it: the refusal is the engine's)."""
    block = _block()
    graphed = capture_with(recorder(), block, (_x(0), _params(*P_A)), share_activations=False, max_graphs=1)
    with pytest.raises(RuntimeError, match="let go of its graph"):
        _twice(graphed, block, _no_grad_other)
    assert graphed.num_graphs == 1  # the other signature's, which replaced it
