"""A CPU stand-in for the graph engine's CUDA recorder, shared by the tests that drive the real engine on CPU.

``record`` runs the capture body now and returns its results; ``replay`` re-runs the body and copies the fresh
results into the first ones (the static buffers), which is a CUDA graph's static-memory contract. Everything else
(signatures, static buffers, chained layers, grad buffers) is the production engine. Unlike a CUDA capture,
recording executes the body, so tests capture every graph set before the measured passes, with ``.grad`` set to
None.

Released memory (``unowned``) is never more forgiving than the CUDA pool: the pool *may* hand a released block to
any later warm-up or capture, and a graph captured after the release *may* write it at every replay; here they
always do, with NaNs. A tensor the engine left on released memory while something could overwrite it then reads
NaN instead of passing by luck.

:class:`CaptureLikeRecorder` records as CUDA does in one more respect: its recording writes no tensor older than
the capture, so a test can tell a write made by a replay from one made by the capture.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from packgraph.graphs.handouts import unowned_storage


def _poison(storage):
    n = storage.nbytes() // 4
    if n:
        torch.empty(0, dtype=torch.float32).set_(storage, 0, (n,), (1,)).fill_(float("nan"))


class EagerRecorder:
    device_type = "cpu"
    records_by_running = True  # replay re-runs the recorded body on the same autograd graph: the engine keeps it

    def __init__(self):
        self.clock = 0  # graphs recorded so far
        self.released = []  # (owning storage kept alive here, its pool, clock at its release)
        self.poisonings = 0

    def check_input(self, t):
        pass

    def unowned(self, storage, pool=None):
        # CPU memory has no pool: keep the block alive here and hand back an alias that does not own it.
        self.released.append((storage, pool, self.clock))
        return unowned_storage(storage)

    def reuse_released(self, pool, recorded_at=None):
        """What ``pool`` may do to its released memory: a warm-up or capture now (``recorded_at=None``), or a replay
        of a graph recorded at clock ``recorded_at`` (only memory released before that graph was recorded)."""
        for storage, where, at in self.released:
            if where is pool and (recorded_at is None or at < recorded_at):
                _poison(storage)
                self.poisonings += 1

    def warmup(self, run, iters, pool=None):
        self.reuse_released(pool)
        for _ in range(iters):
            run()

    def new_pool(self):
        return object()  # a distinct pool token: the engine keeps graphs of different pools apart

    def record(self, body, pool=None):
        self.reuse_released(pool)
        self.clock += 1
        results = body()
        return EagerReplay(self, body, results, pool), results


class EagerReplay:
    def __init__(self, recorder, body, results, pool):
        self.recorder, self.recorded_at, self.pool = recorder, recorder.clock, pool
        self.body, self.results, self.replays = body, results, 0

    def replay(self):
        self.replays += 1
        self.recorder.reuse_released(self.pool, self.recorded_at)
        with torch.no_grad():
            for old, new in zip(self.results, self.body(), strict=True):
                old.copy_(new)


class _NoWritesToOlderTensors(TorchDispatchMode):
    """Skips every in-place write whose targets all existed before the mode began; counts the skips."""

    def __init__(self):
        super().__init__()
        self.made = set()  # storages of tensors made under the mode
        self.skipped = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            named = dict(zip([a.name for a in schema.arguments], args, strict=False)) | kwargs
            writes = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            written = [named[n] for n in writes if isinstance(named.get(n), torch.Tensor)]
            if written and all(t.untyped_storage().data_ptr() not in self.made for t in written):
                self.skipped += 1
                return written[0]
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.add(t.untyped_storage().data_ptr())
        return out


class CaptureLikeRecorder(EagerRecorder):
    """An :class:`EagerRecorder` whose recording, like a CUDA capture, writes no tensor that existed before it: the
    body runs (for shapes and the autograd graph), but its in-place writes into older tensors (the shared static
    buffers, say) are skipped, and happen at every replay. Where the engine must move a held tensor off a buffer
    before a replay writes it, only this recorder shows a replay that was not preceded by the move."""

    def __init__(self):
        super().__init__()
        self.skipped_writes = 0

    def record(self, body, pool=None):
        self.reuse_released(pool)
        self.clock += 1
        mode = _NoWritesToOlderTensors()
        with mode:
            results = body()
        self.skipped_writes += mode.skipped
        return EagerReplay(self, body, results, pool), results
