"""The replay-order rule of graphs that share one memory pool, and :class:`GraphOrderError`.

All graphs of a capture group share one pool. Whatever a capture frees goes back to the pool, where a later capture
may place its own tensors: temporaries are always freed at the end of their capture, and with ``share_activations``
(the default) so are the activations a forward saves for its backward, once the backward graph is recorded. The
graphs of one callable also share their static inputs and outputs, signature after signature, and the backward
results of a signature not in use go back to the pool too (:mod:`packgraph.graphs.handouts`). Graph sets of several
signatures (buckets) then hold one set of activations and one set of buffers between them. The price is an order
rule. Replaying a graph recorded at capture number ``s`` may overwrite

* anything captured after ``s`` (its temporaries may lie there),
* activations and backward results freed or released before ``s``,
* the buffers of every graph of the same callable,

which is harmless when a model runs as it was captured (each forward's backward before the next step's forwards) and
silently wrong for a graph whose forward replayed and whose backward has not run yet ("in flight"). The group tracks
those entries and :func:`check_replay_order` raises :class:`GraphOrderError` before such a replay, including a
second forward of the same graph while its first one waits for its backward.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["GraphOrderError", "check_replay_order", "freed_at", "preserve_version"]


class GraphOrderError(RuntimeError):
    """A replay would overwrite memory that a pending backward still needs."""


def preserve_version(t: Tensor) -> contextlib.AbstractContextManager:
    """Write ``t`` in place without bumping its autograd version (the values it holds stay what autograd saved)."""
    return torch.autograd._unsafe_preserve_version_counter(t)


def check_replay_order(entry: Any, seq: int | None, what: str) -> None:
    """Raise :class:`GraphOrderError` if replaying ``entry``'s graph recorded at capture number ``seq`` could
    overwrite memory of a graph of the group whose backward has not run yet (module docstring)."""
    flights = entry.owner.group.in_flight
    if not flights:
        return
    for key, other in list(flights.items()):
        if not other.in_flight:  # its autograd graph was dropped: its backward will never run
            del flights[key]
            continue
        if other is entry:
            if what == "backward":
                continue
            raise GraphOrderError(
                f"{entry.owner.name}: forward replayed again while the backward of its previous replay is still "
                "pending; the replay would overwrite the activations that backward needs. Run the backward first "
                "(or drop the outputs you will not differentiate), call forwards that need no backward under "
                "torch.no_grad() only once no backward is pending, or run this call eagerly."
            )
        same_buffers = other.owner is entry.owner and entry.owner.share_activations
        if not same_buffers and other.pool is not entry.pool:
            continue
        later = seq is not None and (other.fwd_seq > seq or freed_at(other) < seq)
        if same_buffers or later:
            raise GraphOrderError(
                f"{entry.owner.name}: replaying this {what} graph now could overwrite the saved activations or "
                f"outputs of {other.owner.name} (a graph of the same memory pool{' and buffers' * same_buffers}), "
                "whose forward ran and whose backward has not. Run that backward first, or wrap forwards that "
                "need no backward in torch.no_grad()."
            )


def freed_at(entry: Any) -> float:
    """The capture number after which ``entry``'s saved activations are free pool memory (inf: never)."""
    if entry.bwd_seq is None or not entry.owner.share_activations:
        return math.inf
    return entry.bwd_seq
