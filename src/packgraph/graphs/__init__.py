"""The graph engine: capture packed-sequence callables into CUDA graphs, forward and backward, and replay them.

* :func:`capture` one callable; :func:`capture_layers` a layer stack into one memory pool.
* :class:`GraphSignatureError`: a call does not match its graph's static signature (``on_mismatch="error"``).
* :class:`GraphOrderError`: a replay would overwrite memory a pending backward still needs.
* :func:`find_host_syncs` / :class:`HostSync`: what stops a callable from being captured, line by line.
* :func:`loop_stream`: a training loop on one non-default stream (graphs and eager code share cuBLAS workspaces).
* :func:`use_recorder`: the test seam (record with a CPU stand-in instead of CUDA graphs).
"""

from packgraph.graphs.cache import GraphSignatureError
from packgraph.graphs.capture import GraphedCallable, capture, capture_layers
from packgraph.graphs.memory import GraphOrderError
from packgraph.graphs.recorder import loop_stream, use_recorder
from packgraph.host_syncs import GraphCaptureError, HostSync, find_host_syncs

__all__ = [
    "capture",
    "capture_layers",
    "GraphedCallable",
    "GraphSignatureError",
    "GraphOrderError",
    "GraphCaptureError",
    "find_host_syncs",
    "HostSync",
    "use_recorder",
    "loop_stream",
]
