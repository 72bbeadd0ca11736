"""Activation recomputation inside the graphs (``capture(..., recompute=True)``): the forward saves only what the
callable reads and the backward graph runs the forward again. Outputs, grads and ``.grad`` stay eager's; a callable
that draws random numbers is refused, since the recomputed forward would draw other ones."""

import pytest
import torch
from torch import nn

from packgraph.graphs import GraphCaptureError
from packgraph.graphs.capture import capture_layers_with, capture_with
from packgraph.models.gpt import Block, GPTConfig
from tests import eager_recorder as stand_ins
from tests.eager_recorder import EagerRecorder
from tests.graphs.test_autograd_exact import _block, _grads, _loss, _params, _same_grads, _x

SIGS = [_params([10, 20, 5]), _params([3, 3, 30], capacity=16), _params([48], capacity=4)]


@pytest.mark.parametrize("stack", [False, True])
def test_recomputed_graphs_match_eager_over_signatures_and_micro_batches(stack):
    layers = [_block(seed) for seed in range(3 if stack else 1)]
    if stack:
        graphed = capture_layers_with(EagerRecorder(), layers, (_x(0), SIGS[0]), recompute=True)
    else:
        graphed = [capture_with(EagerRecorder(), layers[0], (_x(0), SIGS[0]), recompute=True)]

    def step(stack_fns, seed, micro):
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        outs, xs = [], []
        for m, p in enumerate(micro):
            x = _x(10 * seed + m)
            h = x
            for fn in stack_fns:
                h = fn(h, p)
            _loss(h).backward()
            outs.append(h.detach().clone())
            xs.append(x.grad.clone())
        return outs, xs, [_grads(layer) for layer in layers]

    for seed, micro in enumerate([[SIGS[0]], [SIGS[1], SIGS[0]], [SIGS[2]], [SIGS[1]]]):
        got = step(graphed, seed, micro)
        want = step(layers, seed, micro)
        for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
            torch.testing.assert_close(a, b)
        for a, b in zip(got[2], want[2], strict=True):
            _same_grads(a, b)


def test_the_backward_graph_runs_the_forward_again():
    """Under the stand-in that replays recorded ops, the recomputing backward graph holds the forward's matmuls
    too (up to the last one whose result no grad needs: the recompute stops there)."""
    counts = {}
    for recompute in (False, True):
        block = _block()
        graphed = capture_with(stand_ins.OpReplayRecorder(), block, (_x(0), SIGS[0]), recompute=recompute)
        (entry,) = graphed.cache.values()
        mms = [sum(str(op).startswith("aten.mm") for op, *_ in g.log) for g in (entry.fwd.graph, entry.bwd.graph)]
        counts[recompute] = mms
    assert counts[True][0] == counts[False][0]  # the same forward
    assert counts[False][1] + counts[False][0] - 1 <= counts[True][1] <= counts[False][1] + counts[False][0]


def test_recompute_of_a_callable_that_draws_random_numbers_is_refused():
    torch.manual_seed(0)
    block = Block(GPTConfig(d_model=32, n_head=4, n_layer=2, vocab_size=50, dropout=0.1)).double()
    with pytest.raises(GraphCaptureError, match=r"recompute=True, but the callable draws random numbers \(aten\."):
        capture_with(EagerRecorder(), block, (_x(0), SIGS[0]), recompute=True)
    block.eval()  # no dropout in eval: nothing drawn
    capture_with(EagerRecorder(), block, (_x(0), SIGS[0]), recompute=True)


def test_forward_only_graphs_ignore_recompute():
    block = _block()
    graphed = capture_with(
        EagerRecorder(), nn.Sequential(block.mlp), (_x(0, False),), forward_only=True, recompute=True
    )
    assert not graphed.recompute
