"""What breaks a CUDA graph capture: find the lines that would, explain a capture that did, and recover after it.

A CUDA graph records device work only. Anything that makes the host wait for the device (``.item()``,
``.tolist()``, ``.cpu()``, ``bool(tensor)``, ``torch.nonzero``...) either breaks a capture ("operation not
permitted when stream is capturing") or, worse, bakes one batch's value into the graph. Packed-sequence code hits
this constantly: Megatron's unfused THD RoPE walks ``cu_seqlens.tolist()``, and a ``max_seqlen`` computed from
``cu_seqlens`` is a ``.item()``.

* :func:`find_host_syncs` runs the callable once with ``torch.cuda.set_sync_debug_mode("warn")``, records each
  synchronising op with its aten name and Python frame, then attempts a capture to catch capture-illegal calls
  the sync mode does not flag. It needs CUDA: on the CPU nothing synchronises, so there is nothing to find.
* :func:`explain_capture_failure` turns a failed capture into a :class:`GraphCaptureError` naming the offending
  line and the usual fix; :func:`packgraph.capture` raises it.
* :func:`gc_paused`, :data:`CAPTURE_KWARGS` and :func:`recover_after_failed_capture` keep a capture from failing
  for reasons of the process rather than the callable, and leave the process usable when one fails.

It imports torch only: the graph engine (``packgraph.graphs``) builds on it, and frames of either are not the
user's line.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import traceback
import warnings
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

__all__ = [
    "HostSync",
    "GraphCaptureError",
    "find_host_syncs",
    "explain_capture_failure",
    "gc_paused",
    "is_capture_error",
    "recover_after_failed_capture",
]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_ENGINE_DIR = os.path.join(os.path.dirname(__file__), "graphs") + os.sep
_STDLIB_FILES = (os.sep + "contextlib.py", os.sep + "warnings.py")
# torch warns "called a synchronizing CUDA operation"; its "Synchronization debug mode is a prototype" notice
# (emitted when the mode is switched on) must not count as a sync.
_SYNC_MESSAGE = "called a synchronizing CUDA operation"
_CAPTURE_MARKERS = ("capturing", "capture", "cudaErrorStreamCapture", "cudaErrorCapturedEvent")

# "thread_local": a dataloader thread pinning memory (cudaHostAlloc) during a capture must not invalidate it.
CAPTURE_KWARGS: dict[str, Any] = (
    {"capture_error_mode": "thread_local"}
    if "capture_error_mode" in inspect.signature(torch.cuda.graph.__init__).parameters
    else {}
)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Keep Python's cyclic garbage collector from running inside a capture (it runs again on exit).

    A collection frees whatever reference cycles became garbage, ``torch.cuda.CUDAGraph`` objects of earlier
    models or captures among them. Freeing a graph destroys its executable graph, a call CUDA forbids while this
    thread captures ("operation not permitted when stream is capturing (function reset)"): the capture is
    invalidated and fails at a later kernel, "operation failed due to a previous error during capture" or
    ``CUBLAS_STATUS_EXECUTION_FAILED``, at a point that depends on when the collector happens to run.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class HostSync:
    """One place that synchronises the host with the device (or otherwise fails under capture).

    Attributes:
        op: the aten op (e.g. ``aten._local_scalar_dense.default`` for ``.item()``, ``aten._to_copy.default`` for
            ``.cpu()``/``.tolist()``), or ``"capture error: ..."`` when found by the capture attempt.
        filename / lineno / function / code: the innermost Python frame outside torch and this engine.
        stack: the user frames, outermost first, as ``"file:line in function"``.
        count: how many times this op synchronised at this line during the run.
    """

    op: str
    filename: str
    lineno: int
    function: str
    code: str
    stack: tuple[str, ...] = ()
    count: int = 1

    @property
    def location(self) -> str:
        return f"{self.filename}:{self.lineno}"

    def __str__(self) -> str:
        times = f" (x{self.count})" if self.count > 1 else ""
        return f"{self.location} in {self.function}: {self.code}  [{self.op}]{times}"


class GraphCaptureError(RuntimeError):
    """A callable could not be captured. ``syncs`` lists what was found; the message names the line and a fix."""

    def __init__(self, message: str, syncs: list[HostSync], location: HostSync | None) -> None:
        super().__init__(message)
        self.syncs = syncs
        self.location = location


# --------------------------------------------------------------------------------------------- frames
def _is_user_frame(filename: str) -> bool:
    return not (
        filename.startswith(_TORCH_DIR)
        or filename.startswith(_ENGINE_DIR)
        or filename == __file__
        or filename.endswith(_STDLIB_FILES)
        or filename.startswith("<frozen")
    )


def _user_frames(frames: list[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    return [f for f in frames if _is_user_frame(f.filename)]


def _host_sync_from_frames(op: str, frames: list[traceback.FrameSummary]) -> HostSync | None:
    user = _user_frames(frames)
    if not user:
        return None
    last = user[-1]
    return HostSync(
        op=op,
        filename=last.filename,
        lineno=last.lineno or 0,
        function=last.name,
        code=(last.line or "").strip(),
        stack=tuple(f"{f.filename}:{f.lineno} in {f.name}" for f in user),
    )


def failing_frame(exc: BaseException) -> HostSync | None:
    """The innermost user frame where ``exc`` (or an exception it was raised from or during) was raised.

    A failed capture often surfaces as the capture-end error, raised in torch, while the exception that broke the
    capture (raised at the user's line) is its ``__context__``: the chain is searched innermost first.
    """
    for e in reversed(_chain(exc)):
        if e.__traceback__ is None:
            continue
        found = _host_sync_from_frames(f"capture error: {_first_line(e)}", traceback.extract_tb(e.__traceback__))
        if found is not None:
            return found
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during, outermost first (a cycle ends the walk)."""
    chain: list[BaseException] = []
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def _is_capture_failure(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _CAPTURE_MARKERS)


def _root_capture_error(exc: BaseException) -> BaseException:
    """The innermost capture failure in ``exc``'s chain: the op that broke the capture, not capture_end's
    "operation failed due to a previous error during capture" raised while it propagated."""
    return next((e for e in reversed(_chain(exc)) if _is_capture_failure(e)), exc)


def is_capture_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or one it chains to) is a CUDA stream-capture failure."""
    return any(_is_capture_failure(e) for e in _chain(exc))


# --------------------------------------------------------------------------------------------- fixes
_FIXES: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("max_seqlen", "max(", ".max()", "amax"),
        "pass max_seqlen statically: a Python int (e.g. the bucket's, via BucketPolicy) instead of one computed "
        "from cu_seqlens on the device",
    ),
    (
        ("rope", "rotary", "position", "tolist"),
        "use packgraph.ops.apply_rope_thd, which computes per-sequence positions on the device (searchsorted), "
        "instead of walking cu_seqlens on the host",
    ),
    (
        ("nonzero", "masked_select", "unique", "argwhere", "[mask]"),
        "avoid data-dependent shapes: keep fixed shapes and mask (torch.where with three arguments, multiply by a "
        "mask) instead of selecting rows",
    ),
    (
        (".item()", ".cpu()", ".numpy()", "float(", "int(", "bool(", "if "),
        "keep the value on the device (tensor ops, torch._assert_async for checks) or compute it before the "
        "captured region and pass it as a static argument",
    ),
)


def suggest_fixes(sync: HostSync) -> list[str]:
    """Fix suggestions for one host sync, from its code line and op (most specific first)."""
    text = f"{sync.code} {sync.function} {sync.filename.rsplit(os.sep, 1)[-1]}".lower()
    fixes = [fix for needles, fix in _FIXES if any(n in text for n in needles)]
    if "nonzero" in sync.op and _FIXES[2][1] not in fixes:
        fixes.append(_FIXES[2][1])
    if not fixes:
        fixes.append(
            "move the host read out of the captured region, or capture a smaller part (capture_layers on the "
            "graph-safe layers, the rest eager)"
        )
    return fixes


def explain_capture_failure(
    exc: BaseException, fn: Callable, args: tuple, kwargs: dict, *, name: str = "callable", rerun: bool = True
) -> GraphCaptureError:
    """A :class:`GraphCaptureError` for a failed capture of ``fn(*args, **kwargs)``.

    The offending line comes from the exception's traceback; with ``rerun`` (and CUDA), :func:`find_host_syncs`
    also runs ``fn`` eagerly, without another capture attempt, to list every synchronising op.
    """
    location = failing_frame(exc)
    syncs: list[HostSync] = []
    if rerun and torch.cuda.is_available():
        try:
            syncs = find_host_syncs(fn, *args, attempt_capture=False, **kwargs)
        except Exception:  # diagnostics must not hide the real error
            syncs = []
    culprit = location or (syncs[0] if syncs else None)
    lines = [f"could not capture {name} into a CUDA graph: {_first_line(_root_capture_error(exc))}"]
    if culprit is not None:
        lines.append(f"  the failing line: {culprit.location} in {culprit.function}: {culprit.code}")
    if syncs:
        lines.append("  host syncs found running it eagerly:")
        lines += [f"    {s}" for s in syncs]
    fixes: list[str] = []
    for s in ([culprit] if culprit is not None else []) + syncs:
        fixes += [f for f in suggest_fixes(s) if f not in fixes]
    if not fixes:
        fixes.append("run packgraph.find_host_syncs(fn, *args) to locate host syncs")
    lines.append("  fix: " + "\n  fix: ".join(fixes))
    return GraphCaptureError("\n".join(lines), syncs, culprit)


# --------------------------------------------------------------------------------------------- detection
class _SyncRecorder:
    """Within the block: sync debug mode "warn", the current aten op tracked, each sync warning recorded."""

    def __init__(self, match: str = _SYNC_MESSAGE) -> None:
        self.match = match
        self.syncs: dict[tuple[str, int, str], HostSync] = {}
        self._ops: list[str] = []

    def __enter__(self) -> _SyncRecorder:
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self._ops

        class _OpTracker(TorchDispatchMode):
            # torch hands a C++ warning to Python when the outermost binding returns, after the op that raised it
            # finished: so the culprit is the last op that *ended* before the warning.
            def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
                try:
                    return func(*args, **(kwargs or {}))
                finally:
                    ops.append(str(func))
                    del ops[:-4]

        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        shown = warnings.showwarning
        warnings.showwarning = self._make_hook(shown)
        self._previous_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        self._tracker = _OpTracker()
        self._tracker.__enter__()
        return self

    def _make_hook(self, shown: Callable) -> Callable:
        def hook(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            if self.match not in str(message):
                shown(message, category, filename, lineno, file, line)
                return
            op = self._ops[-1] if self._ops else "synchronizing CUDA operation"
            self._ops.clear()
            found = _host_sync_from_frames(op, traceback.extract_stack()[:-1])
            if found is None:
                found = HostSync(op, filename, lineno, "?", "")
            key = (found.filename, found.lineno, found.op)
            if key in self.syncs:
                old = self.syncs[key]
                found = HostSync(old.op, old.filename, old.lineno, old.function, old.code, old.stack, old.count + 1)
            self.syncs[key] = found

        return hook

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self._tracker.__exit__(exc_type, exc, tb)
        finally:
            torch.cuda.set_sync_debug_mode(self._previous_mode)
            self._warnings.__exit__(exc_type, exc, tb)


def find_host_syncs(fn: Callable, *args: Any, attempt_capture: bool = True, **kwargs: Any) -> list[HostSync]:
    """Run ``fn(*args, **kwargs)`` and report every host sync, with its aten op and Python frame.

    ``fn`` runs once eagerly on a side stream under ``torch.cuda.set_sync_debug_mode("warn")`` (each
    synchronising op is recorded with the innermost frame outside torch and this engine), then, with
    ``attempt_capture``, once more under a throwaway CUDA graph capture: a capture-illegal call the sync mode does
    not flag is reported as ``op="capture error: ..."`` at the line that raised it. ``fn`` runs for real (its side
    effects happen, twice with the capture attempt). Not every synchronising op is flagged by torch's sync mode
    (see ``torch.cuda.set_sync_debug_mode``), which is what the capture attempt is for.

    Returns:
        the host syncs in the order first seen; empty when ``fn`` is graph-safe.

    Raises:
        RuntimeError: without CUDA (host syncs only exist between a CUDA device and the host).
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "find_host_syncs needs a CUDA device: host syncs only exist between a CUDA device and the host, and on "
            "the CPU every op is already synchronous. Run it on a CUDA machine."
        )
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with _SyncRecorder() as recorder:
            fn(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    syncs = list(recorder.syncs.values())
    if attempt_capture:
        failure = _attempt_capture(fn, args, kwargs, stream)
        if failure is not None and all(s.location != failure.location for s in syncs):
            syncs.append(failure)
    return syncs


def _attempt_capture(fn: Callable, args: tuple, kwargs: dict, stream: torch.cuda.Stream) -> HostSync | None:
    graph = torch.cuda.CUDAGraph()
    pool = torch.cuda.graph_pool_handle()
    previous = torch.cuda.current_stream()
    try:
        with gc_paused(), torch.cuda.graph(graph, pool=pool, stream=stream, **CAPTURE_KWARGS):
            fn(*args, **kwargs)
    except Exception as exc:
        recover_after_failed_capture(previous, previous.device, pool)
        found = failing_frame(exc)
        if found is None:
            found = HostSync(f"capture error: {_first_line(exc)}", "<unknown>", 0, "?", "")
        return found
    finally:
        del graph
    return None


def recover_after_failed_capture(
    previous_stream: torch.cuda.Stream, device: torch.device | None, pool: Hashable | None
) -> None:
    """Best-effort cleanup after a capture raised: torch leaves the capture stream current and, when the capture
    ended in error, the allocator still routing the pool; undo both so eager work can go on."""
    try:
        if torch.cuda.is_current_stream_capturing():
            return  # the capture is still open: nothing safe to do here
        torch.cuda.set_stream(previous_stream)
        end = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end is not None and pool is not None:
            index = device.index if isinstance(device, torch.device) and device.index is not None else 0
            end(index, pool)
    except Exception:
        pass
    _close_generator_capture(device)


def _close_generator_capture(device: torch.device | None) -> None:
    """Take the default CUDA generator out of capture mode after a capture that ended in error.

    ``CUDAGraph.capture_end`` runs the generator's capture epilogue only after ``cudaStreamEndCapture`` succeeds;
    when the capture was invalidated (a host sync inside it) the epilogue is skipped and the generator stays in
    capture mode, so every later random op raises "Offset increment outside graph capture". An empty capture
    on a side stream runs the prologue/epilogue pair once more and closes it, keeping the generator's state
    object (graphs captured earlier stay registered with it).
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
            stream = torch.cuda.Stream(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                graph.capture_begin()
                graph.capture_end()
            del graph
    except Exception:
        pass
