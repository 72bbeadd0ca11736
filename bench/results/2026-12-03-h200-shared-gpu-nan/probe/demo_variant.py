"""packgraph demo with a variant of how the eager code around the graphs meets their stream."""
import sys

import torch

variant, argv = sys.argv[1], sys.argv[2:]
import packgraph.graphs.recorder as recorder  # noqa: E402
import packgraph.graphs.streams as streams  # noqa: E402

inner = streams.on_graph_stream
STREAMS = []
init = recorder.CudaRecorder.__init__


def tracked_init(self, *a, **k):
    init(self, *a, **k)
    STREAMS.append(self.stream)


recorder.CudaRecorder.__init__ = tracked_init

if variant == "single-stream":
    streams.on_graph_stream = lambda graphed, fn, *a, **k: fn(*a, **k)
elif variant == "sync-after":

    def synced(graphed, fn, *a, **k):
        try:
            return inner(graphed, fn, *a, **k)
        finally:
            torch.cuda.synchronize()

    streams.on_graph_stream = synced
if variant in ("record-results", "both"):

    def recorded(graphed, fn, *a, **k):
        caller = torch.cuda.current_stream()
        result = inner(graphed, fn, *a, **k)
        for t in streams._tensors_in(result):
            if t.is_cuda:
                t.record_stream(caller)
        return result

    streams.on_graph_stream = recorded
if variant in ("wait-after-backward", "both"):
    backward = torch.Tensor.backward

    def waited(self, *a, **k):
        out = backward(self, *a, **k)
        for s in STREAMS:
            torch.cuda.current_stream().wait_stream(s)
        return out

    torch.Tensor.backward = waited
from packgraph.cli import main  # noqa: E402

sys.exit(main(argv))
