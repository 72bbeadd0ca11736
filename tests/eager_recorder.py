"""A CPU stand-in for the graph engine's CUDA recorder, shared by the tests that drive the real engine on CPU.

``record`` runs the capture body now and returns its results; ``replay`` re-runs the body and copies the fresh
results into the first ones (the static buffers), which is a CUDA graph's static-memory contract. Everything else
(signatures, static buffers, chained layers, grad buffers) is the production engine. Unlike a CUDA capture,
recording executes the body (a backward body adds into the grad buffers), so tests capture every graph set before
the measured passes, with ``.grad`` set to None.
"""

import torch


class EagerRecorder:
    device_type = "cpu"
    records_by_running = True  # replay re-runs the recorded body on the same autograd graph: the engine keeps it

    def check_input(self, t):
        pass

    def warmup(self, run, iters, pool=None):
        for _ in range(iters):
            run()

    def new_pool(self):
        return object()  # a distinct pool token: the engine keeps graphs of different pools apart

    def record(self, body, pool=None):
        results = body()
        return EagerReplay(body, results), results


class EagerReplay:
    def __init__(self, body, results):
        self.body, self.results, self.replays = body, results, 0

    def replay(self):
        self.replays += 1
        with torch.no_grad():
            for old, new in zip(self.results, self.body(), strict=True):
                old.copy_(new)
