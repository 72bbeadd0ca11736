"""One stream for a whole loop, so that graphs and the eager code around them share cuBLAS workspaces.

cuBLAS keeps one workspace per (thread's handle, stream) it has run on: 32 MiB each on an H200, held until
``torch._C._cuda_clearCublasWorkspaces()``. Graphs replay on the caller's stream, and they are recorded on it too
unless it is the default stream, where CUDA cannot capture (:class:`~packgraph.graphs.recorder.CudaRecorder`). A
loop on the default stream therefore holds the side stream's workspaces (forward's thread and autograd's) on top of
its own. :func:`loop_stream` runs a loop on one non-default stream instead, where everything shares two.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["loop_stream"]


@contextlib.contextmanager
def loop_stream(device: torch.device | str | None, stream: torch.cuda.Stream | None = None) -> Iterator[None]:
    """Run the block on a new non-default CUDA stream of ``device``, or on ``stream`` (on another device, as it is).

    Contract: the stream first waits for the caller's stream, and the device is synchronised when the block ends,
    so work before and after the block is ordered with it however the tensors made inside are used after. Run a
    whole loop in it (model set-up, steps, optimizer, logging), never a part of a step: autograd and the caching
    allocator then see one stream. Graphs of chained layers recorded inside replay only on that stream: a later
    loop over them passes the same ``stream``.
    """
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        yield
        return
    caller = torch.cuda.current_stream(device)
    stream = stream if stream is not None else torch.cuda.Stream(device)
    stream.wait_stream(caller)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        torch.cuda.synchronize(device)
