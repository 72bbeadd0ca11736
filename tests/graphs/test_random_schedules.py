"""Random schedules of what eager allows, on a chained graphed stack against the same layers run eagerly: parameters
frozen and unfrozen, a layer switched between train and eval, ``torch.autograd.grad`` over a subset of the inputs,
``backward(inputs=...)``, one or two micro-batches per step, ``zero_grad`` with or without ``set_to_none``, and a
no-grad scoring call after each step. Every output, input grad, returned grad and ``.grad`` (None included) is
compared step by step.

The seeds are schedules that once failed: a layer's signature changed alone (a frozen parameter of the head, the
train/eval flag of a later layer), so graphs captured at different times ran together in one pool, and a replay
raised GraphOrderError where eager runs on."""

import logging
import random

import pytest
import torch

from packgraph.buckets import default_buckets
from packgraph.graphs.capture import capture_layers_with
from packgraph.params import PackedSeqParams
from tests.eager_recorder import EagerRecorder
from tests.graphs.test_autograd_exact import T, _block, _grads, _loss, _same_grads, _x

SHAPES = [[40], [10, 20, 5], [3] * 10, [1] * 30, [24, 24], [2] * 20, [48], [1] * 40, [7, 9, 11]]


def _params(lengths):
    return PackedSeqParams.from_seqlens(lengths, total_tokens=T, capacity=len(lengths), max_seqlen=T)


def _forward(stack, x, lengths):
    h = x
    for layer in stack:
        h = layer(h, _params(lengths))
    return h


def _step(stack, layers, plan):
    for layer in layers:
        layer.zero_grad(set_to_none=plan["set_to_none"])
    outs, returned = [], []
    for seed, lengths in plan["micro"]:
        x = _x(seed)
        h = _forward(stack, x, lengths)
        outs.append(h.detach().clone())
        loss = _loss(h)
        trainable = [p for layer in layers for p in layer.parameters() if p.requires_grad]
        mode = plan["mode"]
        if mode == "backward":
            loss.backward()
            returned.append(x.grad.clone())
        elif mode == "grad-x":
            returned += torch.autograd.grad(loss, [x])
        elif mode == "grad-params" and trainable:
            returned += [g.clone() for g in torch.autograd.grad(loss, trainable[: max(1, len(trainable) // 3)])]
        else:
            loss.backward(inputs=[x, *trainable[::2]])
            returned.append(x.grad.clone())
    with torch.no_grad():
        outs.append(_forward(stack, _x(99, requires_grad=False), plan["score"]).clone())
    return outs + returned, [_grads(layer) for layer in layers]


@pytest.mark.parametrize("handout_path", ["swap", "scan"], indirect=True)
@pytest.mark.parametrize("seed", [4, 31, 71])
def test_a_random_schedule_matches_eager(seed, handout_path, caplog):
    caplog.set_level(logging.ERROR)  # the engine's warnings about many signatures are expected here
    rng = random.Random(seed)
    layers = [_block(k) for k in range(3)]
    graphed = capture_layers_with(EagerRecorder(), layers, (_x(0), _params([12, 3])), buckets=default_buckets(T))
    for i in range(20):
        change = rng.random()
        if change < 0.25:  # freeze or unfreeze one parameter
            k = rng.randrange(3)
            p = dict(layers[k].named_parameters())[rng.choice([n for n, _ in layers[k].named_parameters()])]
            p.requires_grad_(not p.requires_grad)
        elif change < 0.35:  # switch one layer between train and eval
            k = rng.randrange(3)
            layers[k].train(not layers[k].training)
        plan = {
            "set_to_none": rng.random() < 0.6,
            "mode": rng.choice(["backward", "grad-x", "grad-params", "inputs"]),
            "micro": [(100 * i + m, rng.choice(SHAPES)) for m in range(rng.choice([1, 2]))],
            "score": SHAPES[(seed + i) % len(SHAPES)],
        }
        got, want = _step(graphed, layers, plan), _step(layers, layers, plan)
        for a, b in zip(got[0], want[0], strict=True):
            torch.testing.assert_close(a, b, msg=f"step {i}, {plan}")
        for a, b in zip(got[1], want[1], strict=True):
            _same_grads(a, b)
