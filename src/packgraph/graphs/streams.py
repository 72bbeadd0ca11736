"""Eager code around graphed layers, run on the stream their capture group records on.

cuBLAS keeps one workspace per (thread's handle, stream) it has run on: 32 MiB each on an H200, held until
``torch._C._cuda_clearCublasWorkspaces()``. A graph's GEMMs keep the workspaces of the stream they were captured
on, from the forward's thread and from autograd's. Eager matmuls between graphed layers (an LM head, an eager MLP)
on the caller's stream would hold two more, which eager training never holds. :func:`on_graph_stream` runs them on
the capture stream instead, where they share the graphs' two.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import Tensor

__all__ = ["on_graph_stream", "graph_stream"]

R = TypeVar("R")


def graph_stream(graphed: Any) -> torch.cuda.Stream | None:
    """The CUDA stream ``graphed`` (a :class:`~packgraph.graphs.GraphedCallable`) records on; None for a stand-in
    recorder or an object without a capture group."""
    group = getattr(graphed, "group", None)
    stream = getattr(getattr(group, "recorder", None), "stream", None)
    return stream if isinstance(stream, torch.cuda.Stream) else None


def on_graph_stream(graphed: Any, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """``fn(*args, **kwargs)`` run on ``graphed``'s capture stream, as if it ran on the caller's current stream.

    Contract (what keeps it equal to a call on the caller's stream):

    * the capture stream first waits for the caller's stream, where ``fn``'s inputs were made;
    * at return the caller's stream waits for ``fn``'s work, and every tensor in the result (inside tuples, lists
      and mappings) is recorded on the caller's stream, so the allocator does not reuse its memory while the
      caller's later work reads it;
    * a backward through the results runs ``fn``'s ops on the capture stream, and autograd makes the caller's
      stream wait for them (PyTorch's stream semantics of backward passes). Grads autograd creates there (the
      ``.grad`` of parameters ``fn`` used) belong to the capture stream; the next call's wait orders its work after
      the caller's use of them.

    Graphs replayed inside ``fn`` run on the capture stream too. Without a CUDA recorder (a CPU stand-in), or when
    the caller is already on that stream, ``fn`` runs as it is.
    """
    stream = graph_stream(graphed)
    if stream is None:
        return fn(*args, **kwargs)
    caller = torch.cuda.current_stream(stream.device)
    if caller == stream:
        return fn(*args, **kwargs)
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        result = fn(*args, **kwargs)
    caller.wait_stream(stream)
    _record_on(result, caller)
    return result


def _record_on(obj: Any, stream: torch.cuda.Stream) -> None:
    if isinstance(obj, Tensor):
        if obj.is_cuda:
            obj.record_stream(stream)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            _record_on(v, stream)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _record_on(v, stream)
