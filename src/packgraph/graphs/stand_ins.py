"""What warm-up and capture run under: stand-in leaves for the parameters, and the grad and autocast modes.

Warm-up and capture run on a side stream. If they used the real parameters, the autograd graph a capture keeps
(until a late backward capture) would hold the parameters' ``AccumulateGrad`` nodes, which autograd reuses, with
the side stream, on the caller's stream ("The AccumulateGrad node's stream does not match ..."). Fresh leaves that
share each parameter's storage and version counter stand in for them instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from packgraph.graphs.signature import autocast_state

__all__ = ["capture_mode", "parameters_replaced", "stand_in_leaf"]


def stand_in_leaf(p: Tensor) -> Tensor:
    """A leaf sharing ``p``'s storage and version counter, of ``p``'s class (code may check for ``Parameter``)."""
    if isinstance(p, torch.nn.Parameter):
        return torch.nn.Parameter(p.detach(), requires_grad=p.requires_grad)
    return p.detach().requires_grad_(p.requires_grad)


@contextlib.contextmanager
def parameters_replaced(owner: Any, replacement: dict[int, Tensor]) -> Iterator[None]:
    """Within the block, every parameter slot of ``owner``'s module (``owner.param_slots()``) that holds a key of
    ``replacement`` holds its value."""
    swapped = []
    try:
        if replacement:
            for table, name, t, _ in owner.param_slots():
                new = replacement.get(id(t))
                if new is not None and table.get(name) is t:
                    table[name] = new
                    swapped.append((table, name, t))
        yield
    finally:
        for table, name, t in swapped:
            table[name] = t


@contextlib.contextmanager
def capture_mode(owner: Any, train: bool) -> Iterator[None]:
    """Grad mode for a training (or forward-only) capture, and the caller's autocast state without its cast cache."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad() if train else torch.no_grad())
        device_type = owner.group.recorder.device_type
        dtype = autocast_state(device_type)
        if dtype is not None:
            # A cached cast of a weight would be baked into the graph and go stale after optimizer.step().
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=False))
        yield
