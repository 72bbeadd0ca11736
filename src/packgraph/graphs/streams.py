"""Eager code around graphed layers, run on the stream their capture group records on.

cuBLAS keeps one workspace per (thread's handle, stream) it has run on: 32 MiB each on an H200, held until
``torch._C._cuda_clearCublasWorkspaces()``. A graph's GEMMs keep the workspaces of the stream they were captured
on, from the forward's thread and from autograd's. Eager matmuls between graphed layers (an LM head, an eager MLP)
on the caller's stream would hold two more, which eager training never holds. :func:`on_graph_stream` runs them on
the capture stream instead, where they share the graphs' two.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch import Tensor

from packgraph.params import PackedSeqParams

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

    * the capture stream first waits for the caller's stream, where ``fn``'s inputs were made, and every tensor
      among the arguments is recorded on the capture stream: autograd may free an input it saved when the
      backward that read it (queued on the capture stream) has not run yet, and the caller's stream must not get
      that memory back before then;
    * at return the caller's stream waits for ``fn``'s work. The results belong to the capture stream's cache, and
      they are not recorded on the caller's stream: when the caller frees one, the next work that could reuse its
      memory on the capture stream is ordered after the caller's reads of it (the next call's first wait, or the
      sync autograd makes at the start of a backward). Recording them would keep each freed result allocated
      until the caller's stream catches up, on top of the next step's peak;
    * a backward through the results runs ``fn``'s ops on the capture stream, and autograd makes the caller's
      stream wait for them (PyTorch's stream semantics of backward passes). Grads autograd creates there (the
      ``.grad`` of parameters ``fn`` used) belong to the capture stream; the next call's wait orders its work after
      the caller's use of them.
    * if ``fn`` raises, the caller's stream still waits for the work ``fn`` queued before it raised.

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
    _record_on((args, kwargs), stream)
    try:
        with torch.cuda.stream(stream):
            result = fn(*args, **kwargs)
    finally:
        caller.wait_stream(stream)
    return result


def _record_on(obj: Any, stream: torch.cuda.Stream) -> None:
    """Record every CUDA tensor in ``obj`` on ``stream`` (see :func:`_tensors_in`)."""
    for t in _tensors_in(obj):
        if t.is_cuda:
            t.record_stream(stream)


def _tensors_in(obj: Any) -> Iterator[Tensor]:
    """The tensors in ``obj``, nested in tuples, lists, mappings and dataclasses. A
    :class:`~packgraph.params.PackedSeqParams` gives its :meth:`~packgraph.params.PackedSeqParams.graph_inputs`:
    walking its host offsets (a tuple of ints per field, as long as the capacity) would cost milliseconds per call
    at the large rungs."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, PackedSeqParams):
        yield from obj.graph_inputs().values()
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors_in(getattr(obj, f.name))
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)
