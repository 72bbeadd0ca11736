"""Recorders: what warms up and records the graphs of a capture group. :class:`CudaRecorder` makes CUDA graphs.

The recorder protocol, :class:`Recorder`, states what :class:`CudaRecorder` and the stand-ins of CPU tests
implement, member by member; stand-ins derive from it for the defaults of its optional members.

:func:`use_recorder` is the engine's one test seam: within it, ``capture`` and ``capture_layers`` use the given
recorder instead of a :class:`CudaRecorder`.

**Proxies.** What warm-up and capture run under: proxy leaves for the parameters, and the grad and autocast modes.

Warm-up and capture run on a side stream. If they used the real parameters, the autograd graph a capture keeps
(until a late backward capture) would hold the parameters' ``AccumulateGrad`` nodes, which autograd reuses, with
the side stream, on the caller's stream ("The AccumulateGrad node's stream does not match ..."). Fresh leaves that
share each parameter's storage (proxies, :func:`proxy_leaf`) are trained instead.

**Streams.** One stream for a whole loop, so that graphs and the eager code around them share cuBLAS workspaces.

cuBLAS keeps one workspace per (thread's handle, stream) it has run on: 32 MiB each on an H200, held until
``torch._C._cuda_clearCublasWorkspaces()``. Graphs replay on the caller's stream, and they are recorded on it too
unless it is the default stream, where CUDA cannot capture (:class:`CudaRecorder`). A
loop on the default stream therefore holds the side stream's workspaces (forward's thread and autograd's) on top of
its own. :func:`loop_stream` runs a loop on one non-default stream instead, where everything shares two.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from packgraph import host_syncs
from packgraph.graphs.memory import Pool, Unowned, unowned_storage
from packgraph.graphs.signature import autocast_state

if TYPE_CHECKING:
    from packgraph.graphs.capture import GraphedCallable

__all__ = [
    "CudaRecorder",
    "Graph",
    "Recorder",
    "capture_mode",
    "loop_stream",
    "parameters_replaced",
    "recorder_for",
    "stand_in",
    "proxy_leaf",
    "use_recorder",
]


# ---------------------------------------------------------------------------------------------------------- recorders
class Graph(Protocol):
    """What a recorder records: ``torch.cuda.CUDAGraph``, or a stand-in's graph."""

    def replay(self) -> None: ...


class Recorder(Protocol):
    """What warms up and records a capture group's graphs. The last five members are optional: a recorder that
    derives from this class gets their defaults (no pool, nothing released, no CUDA stream)."""

    device_type: str  # the autocast device type of the signature ("cuda")

    def check_input(self, t: Tensor) -> None:
        """Raise if ``t`` cannot be a graph input (wrong device)."""
        ...

    def warmup(self, run: Callable[[], None], iters: int, pool: Pool | None = None) -> None:
        """Call ``run()`` ``iters`` times, eagerly (CUDA: on the side stream, its memory taken from the pool)."""
        ...

    def record(self, body: Callable[[], list[Tensor]], pool: Pool | None = None) -> tuple[Graph, list[Tensor]]:
        """Capture ``body()`` (which returns the graph's static results) into the recorder's pool, or ``pool``;
        return a graph whose ``replay()`` re-runs the recorded work, writing into those results."""
        ...

    # the shared pool; new_pool() gives a fresh one, for a capture that must not reuse the shared pool's memory (a
    # token that keeps captures apart, without a pool)
    pool: Pool | None = None
    # the pool is also the caller's, for other capture groups whose captures this group cannot see: nothing is
    # released to it
    shares_pool: bool = False
    # a replay runs the body again (a stand-in): the engine keeps the autograd graph a backward body consumes
    records_by_running: bool = False
    stream: torch.cuda.Stream | None = None  # the CUDA stream it records on
    # unowned(storage, pool) -> a storage over the same memory (of ``pool``) that does not keep it allocated, or
    # None: the engine then releases idle backward results to the pool (packgraph.graphs.memory). A stand-in that
    # implements it must treat that memory as reused by every later warm-up and capture into ``pool``, and every
    # replay of a graph of ``pool`` captured after the call, as the CUDA pool may.
    unowned: Unowned | None = None

    def new_pool(self) -> Pool:
        return object()


_RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("packgraph_recorder", default=None)
_POOL_API = all(
    hasattr(torch._C, name) for name in ("_cuda_beginAllocateToPool", "_cuda_endAllocateToPool", "_cuda_releasePool")
)


@contextlib.contextmanager
def use_recorder(recorder: Recorder) -> Iterator[Recorder]:
    """Within the block, :func:`~packgraph.graphs.capture` and :func:`~packgraph.graphs.capture_layers` record with
    ``recorder`` instead of CUDA graphs.

    A stand-in recorder lets CPU tests drive the production engine, and the models and integrations built on it,
    without a GPU (``tests/eager_recorder.py``: one replays by running the aten ops it recorded, and no Python, as
    a CUDA graph does; another by re-running the recorded body). Captures keep the recorder they were made with.
    """
    token = _RECORDER.set(recorder)
    try:
        yield recorder
    finally:
        _RECORDER.reset(token)


def stand_in() -> Recorder | None:
    """The recorder of the innermost :func:`use_recorder` block, or None (capture records CUDA graphs)."""
    return _RECORDER.get()


def recorder_for(pool: Pool | None, sample_args: Any, who: str) -> Recorder:
    """The stand-in of :func:`use_recorder` if one is active, else a :class:`CudaRecorder` on the samples' device."""
    stand_in = _RECORDER.get()
    if stand_in is not None:
        return stand_in
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{who} needs a CUDA device (CUDA graphs), but torch.cuda.is_available() is False on this machine; "
            "run the callable eagerly here"
        )
    tensors = [t for t in pytree.tree_leaves(sample_args) if isinstance(t, Tensor)]
    elsewhere = next((t.device for t in tensors if not t.is_cuda), None)
    if elsewhere is not None:
        raise RuntimeError(
            f"{who} records CUDA graphs: its sample tensors must be on a CUDA device, but one is on {elsewhere}. Move "
            "the module and the inputs with .cuda(), or run the callable eagerly there"
        )
    return CudaRecorder(pool, next((t.device for t in tensors), None))


class CudaRecorder(Recorder):
    """Warms up and records CUDA graphs on one stream (the caller's, or a side stream when the caller is on the
    default stream) into one memory pool (``pool``).

    Warm-up runs allocate from the pool too (where torch exposes the allocator's pool routing): an eager warm-up
    before a capture then reuses the memory that the graphs' temporaries and freed activations occupy instead of
    adding an activation set of its own to the peak. The recorder holds each pool it warms up in until it is garbage
    collected, so the pool exists before its first graph.
    """

    device_type = "cuda"

    def __init__(self, pool: Pool | None = None, device: torch.device | None = None) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        # Another capture group may allocate in a pool the caller passed, where this group's handouts are not seen.
        self.shares_pool = pool is not None
        # Graphs replay on the stream of each call. They are recorded on the caller's stream too, unless it is the
        # default stream, on which CUDA cannot capture: a side stream records them there, and every warm-up and
        # capture synchronises the device, so it adds no order to keep. A loop run on one non-default stream
        # (packgraph's trainers and benchmark) thus runs its eager kernels, records and replays on one stream, and
        # its matmuls share the graphs' cuBLAS workspaces (cuBLAS keeps one per thread and stream).
        current = torch.cuda.current_stream(self.device)
        self.stream = current if current != torch.cuda.default_stream(self.device) else torch.cuda.Stream(self.device)
        self._held: set[Pool] = set()

    def check_input(self, t: Tensor) -> None:
        if t.device != self.device:
            raise ValueError(f"graph inputs must be on {self.device}; got a tensor on {t.device}")

    def warmup(self, run: Callable[[], None], iters: int, pool: Pool | None = None) -> None:
        # Lazy initialisation (cuBLAS workspaces, autotuning) must not land inside a capture.
        torch.cuda.synchronize(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream), _without_donated_buffers(), self._allocating_in(pool or self.pool):
            for _ in range(iters):
                run()
        torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def _allocating_in(self, pool: Pool | None) -> Iterator[None]:
        if not _POOL_API:
            yield
            return
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        torch._C._cuda_beginAllocateToPool(index, pool)  # every stream and thread: the backward runs on another
        try:
            yield
        finally:
            torch._C._cuda_endAllocateToPool(index, pool)
            if pool in self._held:
                torch._C._cuda_releasePool(index, pool)
            else:  # keep the first use: the pool then outlives warm-ups that precede its first graph
                self._held.add(pool)
                weakref.finalize(self, _release_pool, index, pool)

    def new_pool(self) -> Pool:
        return torch.cuda.graph_pool_handle()

    def unowned(self, storage: torch.UntypedStorage, pool: Pool | None = None) -> torch.UntypedStorage:
        # The block goes back to the pool when the owning storage dies; graphs keep writing its addresses.
        return unowned_storage(storage)

    def record(self, body: Callable[[], list], pool: Pool | None = None) -> tuple[Graph, list]:
        graph = torch.cuda.CUDAGraph()
        pool = self.pool if pool is None else pool
        previous = torch.cuda.current_stream(self.device)
        try:
            with (
                host_syncs.gc_paused(),  # a collection freeing an old graph would invalidate this capture
                torch.cuda.graph(graph, pool=pool, stream=self.stream, **host_syncs.CAPTURE_KWARGS),
                _without_donated_buffers(),
            ):
                results = body()
        except BaseException:
            host_syncs.recover_after_failed_capture(previous, self.device, pool)
            raise
        return graph, results


def _release_pool(index: int, pool: Pool) -> None:
    with contextlib.suppress(Exception):  # at interpreter exit the allocator may be gone already
        torch._C._cuda_releasePool(index, pool)


def _without_donated_buffers() -> contextlib.AbstractContextManager:
    """A torch.compile'd callable compiled in here keeps its saved activations for a retained backward.

    By default AOTAutograd donates saved activations to the backward, which then refuses ``retain_graph=True``
    ("compiled with non-empty donated buffers"); the engine retains the backward's graph when activations are not
    shared (``share_activations=False``), so a compiled layer is compiled, during warm-up, without donation.
    """
    try:
        import torch._functorch.config as config
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(config, "donated_buffer"):
        return contextlib.nullcontext()
    return config.patch(donated_buffer=False)


# ------------------------------------------------------------------------------------------------------------ proxies
def proxy_leaf(p: Tensor) -> Tensor:
    """A leaf sharing ``p``'s storage, of ``p``'s class (code may check for ``Parameter``), with a version counter
    of its own: the autograd graph a forward capture keeps for a backward captured at its first use saves it, and an
    ``optimizer.step()`` between the two (a no-grad call met the signature first) changes the values, not the
    graphs, which read the parameter's memory at every replay."""
    leaf = torch.empty(0, dtype=p.dtype, device=p.device)
    with torch.no_grad():
        leaf.set_(p.untyped_storage(), p.storage_offset(), p.size(), p.stride())
    if isinstance(p, torch.nn.Parameter):
        return torch.nn.Parameter(leaf, requires_grad=p.requires_grad)
    return leaf.requires_grad_(p.requires_grad)


@contextlib.contextmanager
def parameters_replaced(owner: GraphedCallable, replacement: dict[int, Tensor]) -> Iterator[None]:
    """Within the block, every parameter place of ``owner``'s module (``owner.param_places()``) that holds a key of
    ``replacement`` holds its value."""
    swapped = []
    try:
        if replacement:
            for table, name, t, _ in owner.param_places():
                new = replacement.get(id(t))
                if new is not None and table.get(name) is t:
                    table[name] = new
                    swapped.append((table, name, t))
        yield
    finally:
        for table, name, t in swapped:
            table[name] = t


@contextlib.contextmanager
def capture_mode(owner: GraphedCallable, train: bool) -> Iterator[None]:
    """Grad mode for a training (or forward-only) capture, and the caller's autocast state without its cast cache."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad() if train else torch.no_grad())
        device_type = owner.group.recorder.device_type
        dtype = autocast_state(device_type)
        if dtype is not None:
            # A cached cast of a weight would be baked into the graph and go stale after optimizer.step().
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=False))
        yield


# ------------------------------------------------------------------------------------------------------------ streams
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
