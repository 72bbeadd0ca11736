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

:class:`OpReplayRecorder` replays as CUDA does: the aten ops recorded at capture, on the tensors captured, and no
Python. It is the stand-in that is never more forgiving than a CUDA graph (a module changed after capture, a Python
side effect, a host read, a value baked in at capture all show); ``tests/conftest.py`` runs every engine, model and
integration test that uses ``EagerRecorder`` under it as well. Its op logs keep every tensor they name alive, where
CUDA frees a tensor nothing else holds, so it overwrites such tensors where CUDA may reuse their memory: a tensor of
an earlier graph that a recording let go of (an activation a backward recorded without ``retain_graph`` read) at
every replay of that recording; and any memory a recording made that nothing but the logs holds any more, at every
later warm-up and capture in its pool and at every replay of the graphs recorded after it was let go, as the
memory the engine releases itself (``unowned``).
"""

import collections
import sys
import weakref

import torch
import torch.utils._pytree
from torch.utils._python_dispatch import TorchDispatchMode

from packgraph.graphs.memory import unowned_storage
from packgraph.graphs.recorder import Recorder


def _poison(storage):
    # every byte 0xFF: a NaN in each floating dtype (exponent and mantissa all ones), -1 in each signed integer one
    torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,)).fill_(255)


class EagerRecorder(Recorder):
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


# ---------------------------------------------------------------------------------------------------- op replay
_NO_KERNEL = {  # allocations only: a CUDA graph records nothing for them, so a replay leaves their memory alone
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
}
_HOST_READS = ("tolist", "numpy", "__array__")  # CPU tensors read these without an op: caught by name at record


def _capture_refusal(what):
    # CUDA's words, so that the engine explains it as it explains a real capture failure.
    return RuntimeError(
        f"operation not permitted when stream is capturing: {what} reads device values on the host (a host sync)"
    )


class _OpRecording(TorchDispatchMode):
    """Logs every aten op of a capture body as ``(op, args, kwargs, outputs to refill)``.

    Like a CUDA capture, it writes no tensor older than the capture (the write is logged, and happens at replay), and
    it refuses what a capture refuses: an op that reads device values on the host or whose output shape depends on
    them (``.item()``, ``bool(t)``, ``nonzero``, ``masked_select``...).
    """

    def __init__(self):
        super().__init__()
        self.log = []
        self.made = set()  # storages allocated under the mode (the capture's own memory)
        self.skipped_writes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tags = func.tags
        data_dependent = torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags
        if data_dependent and not _integer_indexing(func, args):
            raise _capture_refusal(str(func))
        schema = func._schema
        if schema.is_mutable:
            named = dict(zip([a.name for a in schema.arguments], args, strict=False)) | kwargs
            written = [
                t
                for a in schema.arguments
                if a.alias_info is not None and a.alias_info.is_write
                for t in (named.get(a.name) if isinstance(named.get(a.name), (list, tuple)) else [named.get(a.name)])
                if isinstance(t, torch.Tensor)
            ]
            self.log.append((func, args, kwargs, None))
            if written and all(t.untyped_storage().data_ptr() not in self.made for t in written):
                self.skipped_writes += 1
                out = written[0]
                return out if len(schema.returns) == 1 else tuple(written)
            out = func(*args, **kwargs)
            _wait_collective(func, out)  # its completion ops (gloo's split and copy_) run here, not logged
            return out
        out = func(*args, **kwargs)
        refill = []
        for k, (t, ret) in enumerate(_returned(schema, out)):
            if isinstance(t, torch.Tensor) and ret.alias_info is None:  # not a view of what the replay refills
                self.made.add(t.untyped_storage().data_ptr())
                refill.append((k, t))
        if func not in _NO_KERNEL:
            self.log.append((func, args, kwargs, refill))
        return out


def _wait_collective(func, out):
    """Wait on a collective's Work (a ``c10d`` op returns one): a CUDA graph orders the collective on its stream, the
    CPU must wait for it. Waiting here, inside the recording's dispatch, also keeps the ops that complete it (gloo
    finishes a reduce-scatter with ``split`` and ``copy_`` when waited on) out of the op log: they belong to the
    collective, which the replay re-runs whole."""
    if func.namespace != "c10d":
        return
    for work in out if isinstance(out, tuple) else (out,):
        if hasattr(work, "wait"):
            work.wait()


def _integer_indexing(func, args):
    """``aten.index.Tensor`` is tagged dynamic-shape because a boolean index needs ``nonzero``; with integer indices
    its output's shape is theirs and CUDA reads nothing on the host, so a graph captures it (MoE experts gather
    tokens that way)."""
    return func is torch.ops.aten.index.Tensor and all(
        i is None or i.dtype not in (torch.bool, torch.uint8) for i in args[1]
    )


def _returned(schema, out):
    """``(value, its return in the schema)`` for every value an op returned (a ``Tensor[]`` return flattened)."""
    if len(schema.returns) == 1 and isinstance(out, (tuple, list)):
        return [(t, schema.returns[0]) for t in out]
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return list(zip(outs, schema.returns, strict=False))


class OpReplayRecorder(CaptureLikeRecorder):
    """A stand-in that replays like a CUDA graph: ``record`` logs the aten ops the body dispatches (a
    ``TorchDispatchMode``) and ``replay`` runs exactly those ops again on the tensors captured, running no Python.

    Recording executes the ops (for shapes and the autograd graph), but writes no tensor older than the capture and
    leaves NaN in every floating tensor it made, as a capture leaves them unwritten; a replay re-runs each op,
    writes its results into the tensors recorded (no version bump, no autograd, autocast off: the ops are already
    the cast ones), and leaves allocations alone. A module changed after capture, a Python side effect, a value
    read on the host or a tensor reached outside the arguments is then as stale here as in a CUDA graph.
    """

    records_by_running = False  # replays run no autograd: the engine may free what the backward capture consumed

    def __init__(self):
        super().__init__()
        self.replays = []  # weak references to this recorder's replays, whose op logs hold tensors CUDA would not
        self.let_go = []  # (storage, its pool, clock): memory of earlier graphs that nothing but the op logs holds
        self._let_go = set()  # their _cdata

    def record(self, body, pool=None):
        self._let_go_of_dead()
        self.reuse_released(pool)
        self.clock += 1
        recording = _OpRecording()
        saved = {name: getattr(torch.Tensor, name) for name in _HOST_READS}
        try:
            for name in _HOST_READS:
                setattr(torch.Tensor, name, _refuse(name))
            with recording:
                results = body()
        finally:
            for name, method in saved.items():
                setattr(torch.Tensor, name, method)
        self.skipped_writes += recording.skipped_writes
        with torch._C._AutoDispatchBelowADInplaceOrView():  # no version bump: autograd saved these tensors
            for _, _, _, refill in recording.log:
                for _, t in refill or ():
                    if t.is_floating_point():
                        t.fill_(float("nan"))  # unwritten until the first replay
        replay = OpReplay(self, recording.log, results, pool)
        for u in _log_tensors(recording.log):
            storage = u.untyped_storage()
            replay.index.setdefault(storage._cdata, {}).setdefault(id(u), [u, 1])[1] += 1  # +1: the index's
            if storage.data_ptr() in recording.made:
                replay.made.add(storage._cdata)
        u = None  # no reference of this frame's may count below
        self.replays.append(weakref.ref(replay))
        # What this recording read, made before it, and let go of: a CUDA capture frees it during the recording (a
        # backward recorded without retain_graph frees each activation once read) and may reuse its memory for
        # the graph's later tensors, so every replay may leave it overwritten.
        reads = {
            t.untyped_storage()._cdata for t in _log_tensors(recording.log, reads_only=True) if t.is_floating_point()
        }
        dead = self._held_by_logs_alone(reads - replay.made)
        replay.freed = list(
            {
                id(t): t for t in _log_tensors(recording.log, reads_only=True) if t.untyped_storage()._cdata in dead
            }.values()
        )
        for u in replay.freed:
            replay.index[u.untyped_storage()._cdata][id(u)][1] += 1
        return replay, results

    def warmup(self, run, iters, pool=None):
        self._let_go_of_dead()
        super().warmup(run, iters, pool)

    def reuse_released(self, pool, recorded_at=None):
        super().reuse_released(pool, recorded_at)
        for storage, where, at in self.let_go:
            if where is pool and (recorded_at is None or at < recorded_at):
                _poison(storage)
                self.poisonings += 1

    def _let_go_of_dead(self):
        """Before a warm-up or capture: the memory that earlier recordings made and that nothing but the op logs
        holds any more (an activation whose backward was recorded, a temporary) is free in CUDA's pool, where this
        capture, and at every replay the graph it records, may write it: from now on it is treated as the memory
        the engine releases itself (``unowned``)."""
        live = self._live()
        dead = self._held_by_logs_alone(set().union(*(r.made for r in live)) - self._let_go)
        for replay in live:
            for cdata in dead & replay.made:
                if cdata not in self._let_go:
                    self._let_go.add(cdata)
                    u = next(iter(replay.index[cdata].values()))[0]
                    self.let_go.append((u.untyped_storage(), replay.pool, self.clock))

    def _live(self):
        return [r for r in (ref() for ref in self.replays) if r is not None]

    def _held_by_logs_alone(self, candidates):
        """Those of the ``candidates`` (storages, by ``_cdata``) that nothing holds but the replays (their op logs,
        indexes and ``freed`` lists): no tensor of their own, no Python reference to one of the logs' tensors."""
        on = collections.defaultdict(dict)  # cdata -> id(tensor) -> [tensor, the replays' references to it]
        moved = set()  # storages a log's tensor has left since its recording (the engine's set_)
        for replay in self._live():
            for cdata in candidates & replay.index.keys():
                for i, (u, refs) in replay.index[cdata].items():
                    on[cdata].setdefault(i, [u, 0])[1] += refs
                    if u.untyped_storage()._cdata != cdata:
                        moved.add(cdata)
        u = None  # the loop's name would hold one more reference below
        dead = set()
        for cdata, tensors in on.items():
            if cdata in moved:
                # The engine pointed a tensor of the log at other memory (an alias of a buffer it keeps, after
                # copying into that buffer): what the log names is that memory now, not this storage's, which may
                # be freed already (its _cdata then names nothing).
                continue
            _storage = next(iter(tensors.values()))[0].untyped_storage()  # held: counted below
            # the storage's references: one per tensor on it (the logs' and any other, autograd's saved copies say),
            # and its Python object (``_storage``)
            if torch._C._storage_Use_Count(cdata) - 1 - len(tensors) > 0:
                continue
            # Python's references to each tensor beyond the replays' (3 are this line's: ``on``'s list, getrefcount's
            # argument, the loop's name), and C++'s to its TensorImpl beyond its Python object's and its views'
            # (``_base``): autograd saves an op's input as the same TensorImpl, seen by neither count above
            bases = collections.Counter(id(v._base) for v, _ in tensors.values() if v._base is not None)
            if all(
                sys.getrefcount(u) - 3 - refs == 0 and u._use_count() == 1 + bases[i]
                for i, (u, refs) in tensors.items()
            ):
                dead.add(cdata)
        return dead


def _refuse(name):
    def refused(self, *args, **kwargs):
        raise _capture_refusal(f"Tensor.{name}()")

    return refused


class OpReplay:
    def __init__(self, recorder, log, results, pool):
        self.recorder, self.recorded_at, self.pool = recorder, recorder.clock, pool
        self.log, self.results, self.replays = log, results, 0
        self.freed = []  # tensors of earlier graphs this one let go of (OpReplayRecorder._freed_by)
        # storage (_cdata) -> id(tensor) -> [a tensor of the log on it, references to it from the log and here]
        self.index = {}
        self.made = set()  # the storages its recording made (_cdata)

    def replay(self):
        self.replays += 1
        self.recorder.reuse_released(self.pool, self.recorded_at)
        with torch._C._AutoDispatchBelowADInplaceOrView(), torch.autocast("cpu", enabled=False):
            for func, args, kwargs, refill in self.log:
                out = func(*args, **kwargs)
                _wait_collective(func, out)
                if refill:
                    fresh = _returned(func._schema, out)
                    for k, target in refill:
                        target.copy_(fresh[k][0])
            for t in self.freed:
                t.fill_(float("nan"))  # memory the graph let go of, and may have reused


def _log_tensors(log, reads_only=False):
    """Every tensor an op log holds: the ops' arguments and the outputs it refills (``reads_only``: arguments)."""
    for _, args, kwargs, refill in log:
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                yield t
        if not reads_only:
            for _, t in refill or ():
                yield t
