"""A graph replays the module tree it was captured from. A tree changed since (a submodule, parameter, buffer or
hook added, removed or replaced) is noticed on the host at the next call, and the graphs are captured again, as
for a parameter that moved: the call then equals eager on the new tree, grads included.

Under ``OpReplayRecorder`` (``tests/conftest.py`` runs each test under both stand-ins) a replay runs only the ops
recorded at capture, so a missed change shows up as a stale output or a missing grad, as it would on CUDA.
"""

import logging

import pytest
import torch
from torch import nn

from packgraph.graphs.capture import capture_with
from tests.eager_recorder import EagerRecorder

D = 8


def _x(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, D, dtype=torch.float64, generator=g, requires_grad=True)


def _linear(seed):
    torch.manual_seed(seed)
    return nn.Linear(D, D).double()


def _run(fn, module, x):
    """Output, input grad and every parameter's grad (None kept) of ``fn(x).pow(2).sum()``."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    out.pow(2).sum().backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}
    return out.detach().clone(), x.grad.clone(), grads


def _assert_matches_eager(graphed, module, seed):
    got, want = _run(graphed, module, _x(seed)), _run(module, module, _x(seed))
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        assert (got[2][name] is None) == (want[2][name] is None), name
        if want[2][name] is not None:
            torch.testing.assert_close(got[2][name], want[2][name], msg=name)


class _Scaled(nn.Module):
    """``lin(x) * scale`` (a buffer), plus an optional extra parameter added after capture."""

    def __init__(self):
        super().__init__()
        self.lin = _linear(1)
        self.register_buffer("scale", torch.full((D,), 2.0, dtype=torch.float64))
        self.extra = None

    def forward(self, x):
        y = self.lin(x) * self.scale
        return y if self.extra is None else y + self.extra


def _replace_submodule(m):
    m[1] = _linear(7)


def _remove_submodule(m):
    del m[1]


def _add_submodule(m):
    m.append(_linear(8))


def _replace_buffer(m):
    m[0].scale = torch.full((D,), -3.0, dtype=torch.float64)


def _add_parameter(m):
    m[0].extra = nn.Parameter(torch.ones(D, dtype=torch.float64))


def _replace_parameter_in_place_of_its_tensor(m):
    m[1].weight = nn.Parameter(m[1].weight.detach() * 0.5)


def _add_forward_hook(m):
    m[1].register_forward_hook(lambda mod, args, out: out * 10)


CHANGES = [
    _replace_submodule,
    _remove_submodule,
    _add_submodule,
    _replace_buffer,
    _add_parameter,
    _replace_parameter_in_place_of_its_tensor,
    _add_forward_hook,
]


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.lstrip("_"))
def test_a_changed_module_tree_is_recaptured_and_matches_eager(change, caplog):
    model = nn.Sequential(_Scaled(), _linear(2))
    graphed = capture_with(EagerRecorder(), model, (_x(0),))
    _assert_matches_eager(graphed, model, 1)
    change(model)
    with caplog.at_level(logging.WARNING, logger="packgraph.graphs"):
        _assert_matches_eager(graphed, model, 2)
    assert "the module changed since capture" in caplog.text
    assert graphed.captures == 2
    _assert_matches_eager(graphed, model, 3)  # replays of the new graphs
    assert graphed.captures == 2


def test_a_removed_hook_no_longer_runs():
    model = nn.Sequential(_Scaled(), _linear(2))
    handle = model[1].register_forward_hook(lambda mod, args, out: out * 10)
    graphed = capture_with(EagerRecorder(), model, (_x(0),))
    _assert_matches_eager(graphed, model, 1)
    handle.remove()
    _assert_matches_eager(graphed, model, 2)
    assert graphed.captures == 2


def test_an_unchanged_tree_is_not_recaptured():
    model = nn.Sequential(_Scaled(), _linear(2))
    graphed = capture_with(EagerRecorder(), model, (_x(0),))
    model[1] = model[1]  # the same module assigned again
    model.train()
    for seed in range(3):
        _assert_matches_eager(graphed, model, seed)
    assert graphed.captures == 1
