"""A chained stack's hidden-state grad buffers (``packgraph.graphs.memory``), on the CPU stand-in, against eager.

The stand-in keeps the buffers allocated but fills them with NaN whenever the engine gives them back (before a
forward), so a graph that read a buffer across a forward would show NaNs here, where CUDA would read whatever the
memory held.
"""

import torch

from packgraph.graphs.capture import capture_layers_with
from tests.eager_recorder import EagerRecorder
from tests.graphs.test_autograd_exact import _block, _loss, _params, _x

SIG = _params([10, 20, 5], capacity=4)


def _stack(n=4):
    layers = [_block(seed) for seed in range(n)]
    return layers, capture_layers_with(EagerRecorder(), layers, (_x(0), SIG))


def _entry(g):
    return next(iter(g.cache.values()))


def _step(stack, layers, seed, keep=None):
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    x = _x(seed)
    h = x
    for k, layer in enumerate(stack):
        h = layer(h, SIG)
        if keep is not None and k == 1:
            h.register_hook(keep.append)
    _loss(h).backward()
    return [x.grad] + [p.grad.clone() for layer in layers for p in layer.parameters()]


def test_the_last_layer_reads_its_output_grad_from_a_chained_buffer():
    """Two buffers per stack, not three: the grad of the stack's output is copied into slot 1, the last layer
    writes its input grad into slot 0, and so on down the stack."""
    layers, graphed = _stack()
    group = graphed[0].group
    assert len(group.memory.chain_buffers.records()) == 2
    statics = {id(r.static) for r in group.memory.chain_buffers.records()}
    last = _entry(graphed[-1])
    assert id(last.bwd.static_grad_outputs[0]) in statics
    writes = [next(iter(_entry(g).bwd.chain_records.values())).writer[-1] for g in graphed[1:]]
    assert writes == [0, 1, 0]  # layers 1, 2, 3: layer 3 writes slot 0, layer 2 slot 1, layer 1 slot 0
    for seed in range(3):
        got = _step(graphed, layers, seed)
        want = _step(layers, layers, seed)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)


def test_buffers_are_given_back_at_a_forward_unless_a_grad_on_them_is_held():
    layers, graphed = _stack()
    buffers = graphed[0].group.memory.chain_buffers
    _step(graphed, layers, 1)
    graphed[0](_x(2), SIG)  # a forward: the stack's backward is over, nothing held
    assert all(torch.isnan(r.static).all() for r in buffers.records())
    kept = []
    got = _step(graphed, layers, 3, keep=kept)  # a hook keeps the grad layer 2 wrote into a slot
    graphed[0](_x(4), SIG)
    assert not any(torch.isnan(r.static).any() for r in buffers.records())  # still lent: the hook's grad is on one
    want_kept = []
    want = _step(layers, layers, 3, keep=want_kept)
    for g, w in zip(got + kept, want + want_kept, strict=True):
        torch.testing.assert_close(g, w)
    del g, w
    kept.clear()
    graphed[0](_x(5), SIG)
    assert all(torch.isnan(r.static).all() for r in buffers.records())
