"""The engine's memory policy: what the graphs of one capture group share, what they hand out, and when it may be
overwritten.

Eager allocates each tensor when an op makes it and frees it when the last holder drops it. A CUDA graph replays
fixed addresses instead, so the engine decides once, here, which memory graphs share and what it must do to keep
eager's promises about the tensors it hands out:

1. **One pool, and the order rule it costs** (:class:`GraphOrderError`): every graph of a capture group allocates in
   one pool, so captures reuse what earlier ones freed; a replay may then overwrite memory a pending backward needs,
   and that replay is refused.
2. **One set of forward buffers per callable** (:class:`SharedBuffers`): the graphs of every signature (bucket) of a
   callable read and write the same static inputs and outputs.
3. **Handed-out memory** (:class:`HandoutBook`): outputs and grads go out as views of the graphs' memory, without
   copies; a holder still holding one when a replay would write it gets its values moved to memory of its own.
4. **The chained stacks' grad buffers** (:class:`ChainGradBuffers`): the hidden-state grads passed between a chained
   stack's backward graphs live in one block that exists only while a backward uses it.

Each part's rules, where they are enforced:

**1. The replay order.** The replay-order rule of graphs that share one memory pool, and :class:`GraphOrderError`.

All graphs of a capture group share one pool. Whatever a capture frees goes back to the pool, where a later capture
may place its own tensors: temporaries are always freed at the end of their capture, and with ``share_activations``
(the default) so are the activations a forward saves for its backward, once the backward graph is recorded. The
graphs of one callable also share their static inputs and outputs, signature after signature, and the backward
results of a signature not in use go back to the pool too (part 3). Graph sets of several
signatures (buckets) then hold one set of activations and one set of buffers between them. The price is an order
rule. Replaying a graph recorded at capture number ``s`` may overwrite

* anything captured after ``s`` (its temporaries may lie there),
* activations and backward results freed or released before ``s``,
* the buffers of every graph of the same callable,

which is harmless when a model runs as it was captured (each forward's backward before the next step's forwards) and
silently wrong for a graph whose forward replayed and whose backward has not run yet ("in flight"). The group tracks
those entries and :func:`check_replay_order` raises :class:`GraphOrderError` before such a replay, including a
second forward of the same graph while its first one waits for its backward.

**2. Shared buffers.** One set of static buffers per callable, shared by the graphs of all its signatures.

A layer met with several buckets gets one graph set per bucket, but the buffers its graphs read and write on the
forward side have the same shapes in every bucket: the hidden states in and out, the grad of the output.
:class:`SharedBuffers` keeps the first set it sees (the *primary*) and lets every later capture of the same callable
use it: inputs are loaded into the primary's input buffers, and a later graph copies its outputs into the primary's
tensors as its last kernels (a chained next layer reads them in place, whatever the bucket). Backward results
(input and parameter grads) are not shared: each signature writes its own, and they go back to the pool once idle
(part 3), so they cost no second set either and need no zeroing or copy.

Sharing stops where it would be wrong: a buffer of another shape, dtype or stride, or of another ``requires_grad``
(autograd recorded that flag at capture), gets its own tensor; nothing is shared while a graph of the callable is in
flight (its pending backward reads those buffers), and ``share_activations=False`` shares nothing.

**3. Handouts.** Static memory handed out of a graph: outputs, input grads and parameter grads that alias the
graph's buffers.

A replay writes fixed addresses. The engine hands those addresses to the caller without copies: a forward's outputs
are views of the graph's static outputs, and the grads its backward returns to autograd are views of the backward
graph's static results, which autograd's ``AccumulateGrad`` adopts as ``p.grad`` (or ``x.grad``) when there is none
yet, as eager adopts a fresh grad. Eager would keep each of those tensors unchanged for as long as somebody holds
it; a later replay would not. The :class:`HandoutBook` closes that gap.

Views are handed out on a *handle*: a second storage over the graph's memory that does not own it. Every tensor
made from a handed-out view shares the handle (``.detach()``, slices, the ``.grad`` that ``AccumulateGrad`` adopts,
a tensor autograd saved), and no tensor of the engine does, so the handle's reference count says exactly whether
anybody still holds the memory. Before a replay that may write it, a held handle is *settled*: the memory is copied
into a fresh block and the handle swapped onto the copy (``UntypedStorage._swap_data_ptr_``). Every holder, known to
packgraph or not, then keeps its values in memory of its own, with its identity and autograd version unchanged, as
eager's tensors would; the replay writes only the graph's memory. Nobody holding the handle, nothing is copied.

A torch without ``_swap_data_ptr_`` (2.11 has none) moves the holders one by one instead (``Tensor.set_`` onto the
copy): those the engine knows (the tensors it handed out, the ``.grad`` of the parameters a grad was handed out
for, and each tensor ``AccumulateGrad`` adopted from it, which a post-accumulate-grad hook reports), then, only if
something still holds the handle (a ``.detach()`` or a view the caller made), every tensor the garbage collector
tracks (a scan of its objects: tens of milliseconds or more; :data:`scans` counts them). A holder Python cannot reach (a
tensor autograd saved, one exported through DLPack) is left, and the replay raises
:class:`GraphOrderError` rather than overwrite it; so the grads of inputs, which autograd
keeps where Python cannot reach them (``x.grad`` of a leaf, the grad passed to the op that made ``x``), go out as
copies there. Small outputs never need either: they are handed out as copies (:data:`COPIED_OUTPUT_BYTES`).

Which replays may write a storage: the graph that owns it (and the other signatures of the same callable, which
share its buffers), any graph of the same pool captured before the storage was allocated (its temporaries may lie
there), and, once the storage is *released*, any graph of the pool captured after that. Storages are numbered by
the capture that allocated them (``seq``). In the steady state (one backward per step,
``zero_grad(set_to_none=True)``) nobody holds last step's tensors by the first replay of the next step, and the
check costs one reference count per handed-out storage per step, on the host.

Released storages. A backward graph's results (parameter and input grads) are live in a step from that backward
until the optimizer has read them; eager frees them at ``zero_grad``. Pinned by the engine, they would stay
allocated while a later signature (a new bucket) is captured, and its forward would need a second activation set
beside them. So when a new signature's forward is captured, every backward result that nobody holds is released
(:meth:`HandoutBook.release_idle`): the engine keeps an alias that does not own the memory, the block goes back to
the pool, and the new capture may place its tensors there, as eager's allocator would. The graph still writes those
addresses at replay, so a released storage handed out later is settled before any replay of a graph captured after
its release, and before any capture into its pool (whose allocations may land on it). Nothing is released without
``share_activations``, nor in a pool the caller passed (other capture groups may allocate there, and this book does
not see their captures). A chained stack's two hidden-state grad buffers are records too, each written by every other
layer's backward: each such backward settles what is handed out on the buffer it writes.

A handle does not keep the graph's memory allocated, so every handle still held is settled before the engine lets
go of a storage: when a graph is evicted or dropped, and when its capture group is collected.

**4. Chained grad buffers.** The hidden-state grad buffers of a chained layer stack, allocated only while a backward
pass uses them.

A chained stack's backward graphs pass the grad of the hidden states from layer to layer through two fixed buffers
per layout, 0 and 1: the last layer reads buffer 1 (the grad of the stack's output, copied in) and writes buffer 0,
the layer before reads buffer 0 and writes buffer 1, and so on. Eager holds such grads only during its backward. Kept
allocated for good, the two buffers would sit on top of eager's peak, which training reaches at the end of the
forward.

So on CUDA both buffers of a layout share one block, the only block of a :class:`torch.cuda.MemPool` of its own.
:meth:`ChainGradBuffers.lend` allocates it before a backward replay or capture, and :meth:`ChainGradBuffers.give_back`
frees it before a forward, when nothing handed out on it is still held. Nothing else is ever allocated in that pool,
and the block is allocated on one stream with one size, so it comes back at the address the graphs write. Every
lend checks that address. While the block is given back, its memory stays reserved by the pool, as eager's freed
grads stay reserved by the caching allocator.

Without that API (a CPU stand-in, a torch without ``MemPool``) each buffer is its own tensor and stays allocated. A
buffer given back there is filled with NaN (floating dtypes), so a stand-in run that read a buffer across a forward
fails loudly instead of passing where CUDA makes no promise about the contents.
"""

from __future__ import annotations

import contextlib
import gc
import math
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeAlias

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

if TYPE_CHECKING:
    from packgraph.graphs.capture import GraphedCallable
    from packgraph.graphs.entry import Entry
    from packgraph.graphs.recorder import Recorder

__all__ = [
    "COPIED_OUTPUT_BYTES",
    "ChainGradBuffers",
    "GraphOrderError",
    "GroupMemory",
    "Handout",
    "Pool",
    "HandoutBook",
    "KEPT_FOR_HOLDERS",
    "SWAP_DATA_PTR",
    "SharedBuffers",
    "before_capture",
    "before_replay",
    "check_replay_order",
    "in_flight_overlap",
    "let_go_retained",
    "overwrite_retained",
    "retain",
    "fits",
    "freed_at",
    "preserve_version",
    "release_spare_pools",
    "unowned_storage",
]


Pool: TypeAlias = Hashable
"""A memory pool's token: a ``torch.cuda.graph_pool_handle()``, a stand-in recorder's, or :data:`OUTSIDE_POOLS`."""

Unowned: TypeAlias = Callable[[torch.UntypedStorage, Pool], torch.UntypedStorage]
"""A recorder's ``unowned(storage, pool)``: an alias of ``storage`` that lets ``pool`` reuse its memory."""


# --------------------------------------------------------------------------------------------------- the replay order
class GraphOrderError(RuntimeError):
    """A replay would overwrite memory that a pending backward still needs. ``overlap``: why, as
    :func:`in_flight_overlap` says it (None where a handout could not be moved)."""

    def __init__(self, message: str, overlap: str | None = None) -> None:
        super().__init__(message)
        self.overlap = overlap


def preserve_version(t: Tensor) -> contextlib.AbstractContextManager:
    """Write ``t`` in place without bumping its autograd version (the values it holds stay what autograd saved)."""
    return torch.autograd._unsafe_preserve_version_counter(t)


def check_replay_order(entry: Entry, seq: int | None, what: str) -> None:
    """Raise :class:`GraphOrderError` if replaying ``entry``'s graph recorded at capture number ``seq`` could
    overwrite memory of a graph of the group whose backward has not run yet (module docstring)."""
    found = in_flight_overlap(entry, seq, what)
    if found is None:
        if entry.owner.group.memory.retained:
            overwrite_retained(entry, seq, what)
        return
    why, other = found
    if why == "again":
        raise GraphOrderError(
            f"{entry.owner.name}: forward replayed again while the backward of its previous replay is still "
            "pending; the replay would overwrite the activations that backward needs. Run the backward first "
            "(or drop the outputs you will not differentiate), call forwards that need no backward under "
            "torch.no_grad() only once no backward is pending, or run this call eagerly.",
            why,
        )
    raise GraphOrderError(
        f"{entry.owner.name}: replaying this {what} graph now could overwrite the saved activations or "
        f"outputs of {other.owner.name} (a graph of the same memory pool{' and buffers' * (why == 'buffers')}), "
        "whose forward ran and whose backward has not. Run that backward first, or wrap forwards that "
        "need no backward in torch.no_grad().",
        why,
    )


def in_flight_overlap(entry: Entry, seq: int | None, what: str) -> tuple[str, Entry] | None:
    """The first graph of the group whose backward has not run and whose memory a replay of ``entry``'s graph
    recorded at ``seq`` may write, and why: ``"again"`` (``entry`` itself, replayed forward again), ``"buffers"``
    (another signature of the same callable: they share buffers) or ``"pool"`` (captured in one pool in another
    order than they run). None when the replay is safe."""
    for other in entry.owner.group.memory.pending():
        why = _overlap(entry, seq, what, other)
        if why is not None:
            return why, other
    return None


def _overlap(entry: Entry, seq: int | None, what: str, other: Entry) -> str | None:
    if other is entry:
        return None if what == "backward" else "again"
    same_buffers = other.owner is entry.owner and entry.owner.share_activations
    if same_buffers:
        return "buffers"
    if other.pool is entry.pool and seq is not None and (other.fwd.seq > seq or freed_at(other) < seq):
        return "pool"
    return None


def retain(entry: Entry, ctx: object) -> None:
    """``entry``'s backward ran with ``retain_graph=True``: autograd may run it again from ``ctx`` (its node), as
    long as no replay or capture has written the memory it reads since (:func:`overwrite_retained`). Only a graph
    that keeps its activations (``share_activations=False``) is retained: a shared one's backward graph reuses
    them, and its second backward is refused outright (``Replay.backward``)."""
    ctx.overwritten_by = None  # type: ignore[attr-defined]
    entry.owner.group.memory.retained[id(ctx)] = (entry, weakref.ref(ctx))


def overwrite_retained(entry: Entry, seq: int | None, what: str, *, capture: bool = False) -> None:
    """Before ``entry`` replays its graph recorded at ``seq`` (or, with ``capture``, warms up or captures into its
    pool): mark the retained backwards whose memory this may write, so that running one again raises instead of
    reading overwritten activations (eager would run it again: the refusal names the case)."""
    retained = entry.owner.group.memory.retained
    for key, (other, ref) in list(retained.items()):
        ctx = ref()
        if ctx is not None:
            # A capture allocates nothing over a retained graph's memory: its activations and buffers are its own
            # and stay allocated (retain). A replay may write it (_overlap), and a chained graph reads its
            # producer's output in place, whatever the pools: a forward, or its capture, writes that.
            hit = not capture and _overlap(entry, seq, what, other) is not None
            hit = hit or (what != "backward" and other.chained and (capture or _reads_output_of(other, entry)))
            if not hit:
                continue
            why = f"{entry.owner.name} replayed or captured a graph that may have overwritten the activations it reads"
            ctx.overwritten_by = why  # type: ignore[attr-defined]
        del retained[key]


def _reads_output_of(other: Entry, entry: Entry) -> bool:
    outputs = {o.data_ptr() for o in entry.fwd.static_outputs}
    return any(b is not None and b.data_ptr() in outputs for b in other.static_inputs)


def let_go_retained(entries: Sequence[Entry], name: str) -> None:
    """``entries`` leave their callable's cache (evicted, replaced, dropped): their memory goes back to the pool,
    so no retained backward of theirs may run again."""
    retained = entries[0].owner.group.memory.retained if entries else {}
    gone = {id(e) for e in entries}
    for key, (other, ref) in list(retained.items()):
        if id(other) in gone:
            ctx = ref()
            if ctx is not None:
                why = f"{name} let go of its graph (evicted or dropped from its cache)"
                ctx.overwritten_by = why  # type: ignore[attr-defined]
            del retained[key]


def freed_at(entry: Entry) -> float:
    """The capture number after which ``entry``'s saved activations are free pool memory (inf: never)."""
    if entry.bwd is None or not entry.owner.share_activations:
        return math.inf
    return entry.bwd.seq


# ----------------------------------------------------------------------------------------------------- shared buffers
def fits(buf: Tensor, like: Tensor, *, same_grad_flag: bool = False) -> bool:
    """Same shape, dtype, device and strides (and ``requires_grad`` with ``same_grad_flag``)."""
    return (
        buf.shape == like.shape
        and buf.dtype == like.dtype
        and buf.device == like.device
        and buf.stride() == like.stride()
        and (not same_grad_flag or buf.requires_grad == like.requires_grad)
    )


class SharedBuffers:
    """The primary buffers of one callable, by role; ``enabled`` is re-read at each capture."""

    def __init__(self, owner: GraphedCallable, *, enabled: bool = True) -> None:
        self.owner = owner
        self.enabled = enabled
        self._buffers: dict[Hashable, Tensor] = {}
        self._results: dict[Hashable, list[Tensor]] = {}
        self._records: dict[int, Handout] = {}
        # An earlier capture of this callable ran every weight-grad kernel (their shapes do not depend on the
        # signature), so a later warm-up may skip them.
        self.weights_warmed = False

    def _sharing(self) -> bool:
        return self.enabled and not self.owner.any_in_flight()

    def get(self, role: Hashable, like: Tensor, *, zero: bool = False) -> Tensor:
        """The buffer for ``role`` (an input or a grad-output position), holding ``like``'s values (zeros with
        ``zero``): the primary's when it fits, else a new one (kept as the primary's if the role has none)."""
        buf = self._buffers.get(role)
        if buf is not None and self._sharing() and fits(buf, like, same_grad_flag=not zero):
            with torch.no_grad(), preserve_version(buf):
                buf.zero_() if zero else buf.copy_(like)
            return buf
        fresh = torch.zeros_like(like) if zero else like.detach().clone()
        if role not in self._buffers and self.enabled:
            self._buffers[role] = fresh
        return fresh

    def primary(self, role: Hashable) -> Tensor | None:
        """The primary buffer of ``role`` when later signatures would share it (none in flight), else None."""
        buf = self._buffers.get(role)
        return buf if buf is not None and self._sharing() else None

    def write(self, role: Hashable, results: Sequence[Tensor]) -> list[Tensor]:
        """Inside a capture body: ``results`` copied into the primary's tensors for ``role`` when they fit (the
        copies are recorded in the graph), else ``results`` themselves, kept as the primary's if the role has none."""
        results = list(results)
        primary = self._results.get(role)
        if primary is None or not self._sharing() or len(primary) != len(results):
            if primary is None and self.enabled:
                self._results[role] = results
            return results
        if not all(fits(p, r) for p, r in zip(primary, results, strict=True)):
            return results
        with torch.no_grad():
            for p, r in zip(primary, results, strict=True):
                # Autograd may have saved the primary's tensor (an output saved for its own backward): the copy
                # refills it per replay, which is what graphs do, not the change the version check guards.
                with preserve_version(p):
                    p.copy_(r)
        return primary

    @staticmethod
    def free_copied(raw_outputs: Sequence[Tensor], static_outputs: Sequence[Tensor]) -> None:
        """A later signature's forward graph copies its outputs into the primary's buffers; the tensors it copied
        from are graph temporaries. Pointing them at the primary's memory gives theirs back to the pool, where the
        next layer's capture may reuse it (autograd needs only their metadata; an output autograd saved keeps its
        own memory through the saved copy)."""
        for raw, static in zip(raw_outputs, static_outputs, strict=True):
            if raw is static or raw._base is not None or not fits(raw, static):
                continue
            # An alias that owns nothing: the primary's reference count stays the engine's own (part 3).
            alias = unowned_storage(static.untyped_storage())
            with torch.no_grad(), preserve_version(raw):
                raw.set_(alias, static.storage_offset(), static.size(), static.stride())

    def record(self, static: Tensor, *, seq: int, pool: Pool, name: str) -> Handout:
        """The :class:`Handout` of ``static`` (one per tensor, shared like it)."""
        record = self._records.get(id(static))
        if record is None or record.static is not static:
            record = Handout(static, seq=seq, writer=self.owner.uid, pool=pool, name=name)
            self._records[id(static)] = record
        return record

    def keep_only(self, live: Sequence[Entry]) -> None:
        """Forget the records of tensors no live entry holds any more (after evictions)."""
        held = {id(t) for e in live for t in e.statics()}
        self._records = {k: r for k, r in self._records.items() if k in held}

    def clear(self) -> None:
        self.weights_warmed = False
        self._buffers.clear()
        self._results.clear()
        self._records.clear()


# ----------------------------------------------------------------------------------------------------------- handouts
SWAP_DATA_PTR = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
"""Whether this torch can move every holder of a storage at once (else holders are moved one by one, and the
grads of inputs, which autograd may keep out of Python's reach, are handed out as copies)."""

scans = 0
"""Scans of the garbage collector's objects made so far (see the module docstring)."""

settled_bytes = 0
"""Bytes copied so far to move held outputs and grads off graph memory (:meth:`Handout.settle`): what holding them
across replays costs."""

KEPT_FOR_HOLDERS: list[Tensor | _Block] = []
"""Memory the engine let go of while a holder it could not move (see :meth:`Handout.settle_or_keep`) still held
it: kept allocated for the process's lifetime rather than freed under that holder."""

COPIED_OUTPUT_BYTES = 64 * 1024
"""Outputs this small (a loss, a batch's logprobs) that no other graph reads in place are handed out as copies,
which no replay writes: one small kernel per call instead of a settle whenever one is kept (``loss.detach()`` kept
for logging, say)."""


def _storage_refs(cdata: int) -> int:
    return torch._C._storage_Use_Count(cdata)


def unowned_storage(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """A storage over ``storage``'s memory that does not own it: holding it keeps nothing allocated."""
    return torch._C._construct_storage_from_data_pointer(storage.data_ptr(), storage.device, storage.nbytes())


def _on_storage(t: Tensor, cdata: int) -> bool:
    try:
        return t.untyped_storage()._cdata == cdata
    except (RuntimeError, NotImplementedError):  # no storage (sparse, nested, a tensor subclass, a fake tensor)
        return False


def _handle_over(static: Tensor) -> Tensor:
    """A tensor of ``static``'s geometry on a storage of its own over ``static``'s memory, owning none of it."""
    storage = unowned_storage(static.untyped_storage())
    handle = torch.empty(0, dtype=static.dtype, device=static.device)
    return handle.set_(storage, static.storage_offset(), static.size(), static.stride())


class Handout:
    """One static storage that replays write and callers may receive views of (module docstring).

    Args:
        static: the graph's tensor (the engine keeps it; views of its memory are handed out on a handle).
        seq: the capture number that allocated it.
        writer: who writes it at every replay: the callable's uid for a buffer all its signatures share (outputs),
            or one entry's for a signature's own (grads).
        pool: the memory pool it lives in.
        name: used in log lines and errors (``"output 0 of layer[3] Block"``).
    """

    __slots__ = (
        "static", "seq", "writer", "pool", "name", "params", "out", "released_at", "aliases", "_handle", "_cdata",
        "_baseline", "__weakref__",
    )  # fmt: skip

    def __init__(
        self, static: Tensor, *, seq: int, writer: Hashable, pool: Pool, name: str, params: tuple[Tensor, ...] = ()
    ) -> None:
        self.static = static
        self.seq = seq
        self.writer = writer
        self.pool = pool
        self.name = name
        self.params = params  # whose .grad may adopt a view of it (where holders are moved one by one)
        self.out = False
        self.released_at: int | None = None  # the capture number at which the engine let go of the memory
        self.aliases: list[weakref.ref] = []  # tensors known to hold the handle (moved one by one without a swap)
        self._handle: Tensor | None = None
        self._cdata = 0
        self._baseline = 0

    def alias(self) -> Tensor:
        """A fresh view of the memory to hand out, on the handle."""
        if self._handle is None:
            self._handle = _handle_over(self.static)
            self._cdata = self._handle.untyped_storage()._cdata
            self._baseline = _storage_refs(self._cdata)  # the handle alone (and its cached Python storage)
        view = self._handle.detach()
        if not SWAP_DATA_PTR:
            self.aliases.append(weakref.ref(view))
        return view

    def adopted(self, param: Tensor) -> None:
        """``param.grad`` was just set (a post-accumulate-grad hook, without ``_swap_data_ptr_``): know it if it is
        on the handle (``AccumulateGrad`` adopts a tensor of its own, which a caller may keep after ``zero_grad``)."""
        g = param.grad
        if self._handle is not None and g is not None and _on_storage(g, self._cdata):
            self.aliases.append(weakref.ref(g))

    def held(self) -> bool:
        """Whether a tensor handed out on the memory (or made from one) is still alive."""
        return self._handle is not None and _storage_refs(self._cdata) > self._baseline

    def settle(self) -> None:
        """Move every holder of the handle to a copy of the memory in a block of its own; the handle is not reused.

        Raises:
            GraphOrderError: without ``_swap_data_ptr_``, a holder Python cannot reach is left (module docstring).
        """
        known, self.aliases = [a() for a in self.aliases], []
        if not self.held():
            return
        handle, self._handle = self._handle, None
        storage = handle.untyped_storage()
        global settled_bytes
        settled_bytes += storage.nbytes()
        copy = torch.UntypedStorage(storage.nbytes(), device=storage.device)
        copy.copy_(storage)
        if SWAP_DATA_PTR:
            storage._swap_data_ptr_(copy)  # the holders own the copy now; ``copy`` is left with the unowned memory
            return
        self._move_onto(copy, handle, [*known, *(p.grad for p in self.params)])
        if _storage_refs(self._cdata) > self._baseline:  # the baseline counts ``handle`` itself
            global scans
            scans += 1
            # type(), not isinstance: isinstance reads __class__, which a dead weakref.proxy answers with an error
            self._move_onto(copy, handle, (o for o in gc.get_objects() if issubclass(type(o), Tensor)))
        if _storage_refs(self._cdata) > self._baseline:
            raise GraphOrderError(
                f"the {self.name} handed out by an earlier call is still held by a tensor Python cannot reach (saved "
                "by autograd, or exported through DLPack), and this replay would overwrite it; this torch "
                f"({torch.__version__}) has no UntypedStorage._swap_data_ptr_ to move it. Keep a copy (t.clone()) "
                "instead, or use a newer torch."
            )

    def settle_or_keep(self) -> bool:
        """:meth:`settle`, where the engine lets go of the memory (an eviction, the group going away): a holder it
        cannot move keeps the static tensor, and with it the memory, in :data:`KEPT_FOR_HOLDERS`, instead of the
        error. Returns whether it was kept."""
        try:
            self.settle()
        except GraphOrderError:
            KEPT_FOR_HOLDERS.append(self.static)
            return True
        return False

    def _move_onto(self, copy: torch.UntypedStorage, handle: Tensor, holders: Iterable[Tensor | None]) -> None:
        with torch.no_grad():
            for t in holders:
                if t is None or t is handle or not _on_storage(t, self._cdata):
                    continue
                with preserve_version(t):
                    t.set_(copy, t.storage_offset(), t.size(), t.stride())

    def release(self, unowned: Unowned, seq: int) -> bool:
        """Keep the storage through an alias that does not own it (``unowned(storage, pool)``), so the pool may reuse
        the memory in captures numbered ``seq`` and later; only when nobody holds it. Returns whether it was
        released."""
        if self.released_at is not None or self.held():
            return False
        static = self.static
        alias = unowned(static.untyped_storage(), self.pool)
        with torch.no_grad(), preserve_version(static):
            static.set_(alias, static.storage_offset(), static.size(), static.stride())
        self.released_at = seq
        return True

    def exposed_to(self, seq: int) -> bool:
        """Whether a replay of a graph of the same pool captured at ``seq`` may write this storage."""
        return self.seq >= seq or (self.released_at is not None and seq > self.released_at)


class HandoutBook:
    """The handed-out storages of one capture group, by writer, settled before each replay that may write them.

    Per replay the writer's own records are settled; the others are scanned only when one of them may lie in the
    replayed graph's memory (:meth:`Handout.exposed_to`), which in a model's run order happens once per step, at
    its first replay.
    """

    def __init__(self) -> None:
        self._by_writer: dict[Hashable, dict[Handout, None]] = {}
        self._newest = 0  # an upper bound of the seq of every record out
        self._first_release = math.inf  # a lower bound of released_at of every released record out
        self._releasable: dict[int, weakref.ref] = {}  # backward results, released when idle

    def hand_out(self, record: Handout) -> Tensor:
        """A view of ``record``'s storage to return to the caller."""
        if not record.out:
            record.out = True
            self._by_writer.setdefault(record.writer, {})[record] = None
            self._newest = max(self._newest, record.seq)
            if record.released_at is not None:
                self._first_release = min(self._first_release, record.released_at)
        return record.alias()

    def before_replay(self, seq: int | None, writers: tuple[Hashable, ...], pool: Pool) -> None:
        """Settle every handed-out storage that a replay of a graph captured at ``seq`` may write: the ones of its
        ``writers`` (the callable's shared buffers, the entry's own, the chained grad buffer it writes), and the
        others that :meth:`Handout.exposed_to` names."""
        for writer in writers:
            self.settle_writer(writer)
        if seq is None or not self._by_writer or self._newest < seq <= self._first_release:
            return
        self._settle_others(lambda r: r.pool is pool and r.exposed_to(seq))

    def settle_writer(self, writer: Hashable) -> None:
        """Settle every handed-out storage that ``writer`` writes (before its replay, or a capture that writes it)."""
        for record in self._by_writer.pop(writer, None) or ():
            record.out = False
            record.settle()

    def before_capture(self, pool: Pool) -> None:
        """Settle every released storage of ``pool`` still handed out: the capture may allocate its memory."""
        if self._by_writer and self._first_release < math.inf:
            self._settle_others(lambda r: r.pool is pool and r.released_at is not None)

    def _settle_others(self, exposed: Callable[[Handout], bool], *, letting_go: bool = False) -> None:
        newest, first_release = 0, math.inf
        for other in list(self._by_writer):
            records = self._by_writer[other]
            for record in [r for r in records if exposed(r)]:
                del records[record]
                record.out = False
                record.settle_or_keep() if letting_go else record.settle()
            if not records:
                del self._by_writer[other]
                continue
            newest = max(newest, max(r.seq for r in records))
            released = [r.released_at for r in records if r.released_at is not None]
            first_release = min([first_release, *released])
        self._newest, self._first_release = newest, first_release

    def track(self, record: Handout) -> None:
        """``record`` holds a backward graph's result: :meth:`release_idle` may release it."""
        self._releasable[id(record)] = weakref.ref(record)

    def release_idle(self, unowned: Unowned, seq: int) -> int:
        """Release every tracked storage that nobody holds (module docstring). Returns how many."""
        released = 0
        for key, ref in list(self._releasable.items()):
            record = ref()
            if record is None or record.released_at is not None:
                del self._releasable[key]
                continue
            if record.release(unowned, seq):
                released += 1
                del self._releasable[key]
                if record.out:  # handed out, but nobody holds it any more: nothing to settle
                    record.out = False
                    self._by_writer.get(record.writer, {}).pop(record, None)
        return released

    def forget_writer(self, writer: Hashable) -> None:
        """Settle and drop the records of a graph the engine lets go of (evicted, or captured for parameters that
        moved): a handle does not keep the memory allocated, and no replay writes it for its holders any more."""
        for record in self._by_writer.pop(writer, {}):
            record.out = False
            record.settle_or_keep()

    def settle_all(self) -> None:
        """Move every holder of a handed-out storage to memory of its own: the group is going away, and with it the
        graphs' memory."""
        # A finalizer: the garbage collector may run it inside any dispatch mode (torch.compile's FakeTensorMode,
        # while it traces), where the copies would be fake and the holders left on memory the pool gives back.
        with _disable_current_modes():
            self._settle_others(lambda r: True, letting_go=True)


# ------------------------------------------------------------------------------------------------ chained grad buffers
# The pools of closed groups' blocks, by (device, segment size), for the next block of that segment size. A pool
# destroyed by the garbage collector aborted the process once (inside a warm-up that routes allocations to a graph
# pool, with the pool's block still allocated), so pools are destroyed only by release_spare_pools(), at a point the
# caller chooses.
_SPARE_POOLS: dict[tuple[torch.device, int], list[torch.cuda.MemPool]] = {}
# One allocation stream per device for every block: the allocator reuses a free block only on the stream it was
# allocated on, and a spare pool's block must be reusable by the next group.
_ALLOC_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def release_spare_pools() -> None:
    """Destroy the memory pools that closed capture groups left for reuse, which releases the memory they reserve.
    Call it between runs (after dropping the graphs and a ``gc.collect()``), not during a capture or warm-up;
    ``packgraph.bench`` calls it between methods."""
    if _SPARE_POOLS:
        torch.cuda.synchronize()
        _SPARE_POOLS.clear()


def _take_pool(device: torch.device, nbytes: int) -> torch.cuda.MemPool:
    spares = _SPARE_POOLS.get((device, nbytes))
    if spares:
        torch.cuda.synchronize(device)  # the closed group's last replays may still use the block
        return spares.pop()
    with torch.cuda.device(device):
        return torch.cuda.MemPool()


def _alloc_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _ALLOC_STREAMS.get(device)
    if stream is None:
        stream = _ALLOC_STREAMS[device] = torch.cuda.Stream(device)
    return stream


OUTSIDE_POOLS = object()  # the pool of a chained grad buffer: no graph pool, so no capture may place tensors on it

# The caching allocator gives a request of 10 MiB or more a segment of exactly its size rounded up to 2 MiB; a
# smaller one would get a 20 MiB segment. So the pool's one segment is made by a request of at least 10 MiB, and
# the block is then carved from it at its own size: the allocator splits a free block when more than 1 MiB would
# be left over (else it hands out the whole block, which the allocated statistic then counts).
_MIN_EXACT_SEGMENT = 10 * 2**20
_SEGMENT_ROUNDING = 2 * 2**20
_SPLIT_REMAINDER = 2**20
_ALIGN = 512


def _span_bytes(like: Tensor) -> int:
    """Bytes a tensor of ``like``'s shape and strides spans in its storage."""
    if like.numel() == 0:
        return 0
    last = sum((n - 1) * s for n, s in zip(like.shape, like.stride(), strict=True))
    return (last + 1) * like.element_size()


@contextlib.contextmanager
def _no_memory_fill() -> Iterator[None]:
    """``torch.utils.deterministic.fill_uninitialized_memory`` off in the block (it fills only under deterministic
    algorithms)."""
    deterministic = getattr(torch.utils, "deterministic", None)
    if deterministic is None or not getattr(deterministic, "fill_uninitialized_memory", False):
        yield
        return
    deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        deterministic.fill_uninitialized_memory = True


def _lending_api() -> bool:
    return hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")


class _Block:
    """The memory of both buffers of one layout, lent from a pool of its own (CUDA)."""

    def __init__(self, like: Tensor) -> None:
        # First in the instance dict, so freed before the pool even if close() never ran: a MemPool destroyed
        # under a live allocation leaves the allocator a block of a pool it no longer has.
        self.memory: Tensor | None = None
        each = math.ceil(_span_bytes(like) / _ALIGN) * _ALIGN
        self.segment_bytes = math.ceil(max(2 * each, _MIN_EXACT_SEGMENT) / _SEGMENT_ROUNDING) * _SEGMENT_ROUNDING
        split = self.segment_bytes - 2 * each > _SPLIT_REMAINDER
        # What a lend allocates, as the allocated statistic counts it.
        self.nbytes = 2 * each if split else self.segment_bytes
        self.device = like.device
        self.stream = _alloc_stream(self.device)
        self.pool = _take_pool(self.device, self.segment_bytes)
        primer = self._allocate(self.segment_bytes)  # makes the segment (a spare pool has it already, free)
        del primer
        self.memory = self._allocate()
        self.ptr = self.memory.data_ptr()
        self.buffer_bytes = each
        self.statics = [self._view(like, k) for k in (0, 1)]
        with torch.no_grad():
            for s in self.statics:
                s.zero_()

    def _allocate(self, nbytes: int | None = None) -> Tensor:
        # Allocated on the block's own stream, but written and read by the graphs on the caller's, in no order with
        # it: nothing may run on that stream. With deterministic algorithms on, torch.empty fills new memory (0xFF
        # bytes here) with a kernel on the current stream, which a busy GPU ran in the middle of the next backward
        # replay, turning the hidden-state grads to NaN. The graphs write every buffer before they read it, so the
        # fill is skipped; and the caller's stream waits for the block's, should anything else ever run there.
        with _no_memory_fill(), torch.cuda.use_mem_pool(self.pool, self.device), torch.cuda.stream(self.stream):
            block = torch.empty(nbytes or self.nbytes, dtype=torch.uint8, device=self.device)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return block

    def _view(self, like: Tensor, k: int) -> Tensor:
        # A storage over the buffer's bytes that does not own them: the block's memory tensor does, while lent.
        ptr = self.ptr + k * self.buffer_bytes
        storage = torch._C._construct_storage_from_data_pointer(ptr, self.device, self.buffer_bytes)
        return torch.empty(0, dtype=like.dtype, device=self.device).set_(storage, 0, like.shape, like.stride())

    def close(self) -> None:
        """Free the block and keep its pool for the next block of its size (see ``_SPARE_POOLS``)."""
        self.memory = None
        if self.pool is not None:
            _SPARE_POOLS.setdefault((self.device, self.segment_bytes), []).append(self.pool)
            self.pool = None

    def lend(self) -> None:
        if self.memory is not None:
            return
        memory = self._allocate()
        if memory.data_ptr() != self.ptr:
            del memory
            raise RuntimeError(
                "packgraph: the memory pool of a chained stack's hidden-state grad buffers gave back another address "
                f"({hex(self.ptr)} expected), so the captured backward graphs would write memory they do not own. "
                "Something allocated in that pool or released it. Do not route allocations into pools you did not "
                "create; capture the layers again (a new capture_layers call) to recover."
            )
        self.memory = memory


class ChainGradBuffers:
    """The chained grad buffers of one capture group, as :class:`Handout` records.

    Args:
        cuda: the group records CUDA graphs (a stand-in recorder's buffers stay allocated, see the module docstring).
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._records: dict[tuple, Handout] = {}
        self._blocks: dict[tuple, _Block] = {}
        self._lent = True

    def record(self, like: Tensor, position: int, which: int) -> Handout:
        """The record of buffer ``which`` (0 or 1) of ``like``'s layout, for chained input ``position``."""
        layout = (tuple(like.shape), like.stride(), like.dtype, like.device, position)
        record = self._records.get((*layout, which))
        if record is not None:
            return record
        self.lend()
        block = self._blocks.get(layout)
        if block is None and like.is_cuda and self.cuda and _lending_api():
            block = self._blocks[layout] = _Block(like)
        for k in (0, 1):
            if block is not None:
                buf = block.statics[k]
            else:
                buf = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device).zero_()
            name = "grad of the hidden states between chained layers"
            writer = ("chain", layout, k)
            self._records[(*layout, k)] = Handout(buf, seq=0, writer=writer, pool=OUTSIDE_POOLS, name=name)
        return self._records[(*layout, which)]

    def records(self) -> list[Handout]:
        return list(self._records.values())

    def for_backward(self, chained: dict[int, Tensor], grad_outputs: list) -> dict[int, Handout]:
        """The buffer each chained input (``position -> static input``) of a backward graph that reads
        ``grad_outputs`` writes its grad into: the one of the two it does not read, so that the previous layer's
        backward reads it while writing the other."""
        read = {id(g) for g in grad_outputs if g is not None}
        which = 1 if any(id(r.static) in read and r.writer[-1] == 0 for r in self._records.values()) else 0
        return {i: self.record(like, i, which) for i, like in chained.items()}

    def for_stack_output(self, like: Tensor) -> Handout:
        """The buffer the last layer of a chained stack reads the grad of its output from: buffer 1, so that its own
        input grad goes to buffer 0 and the stack holds two such buffers, not three."""
        return self.record(like, 0, 1)

    def lend(self) -> None:
        """Before a backward replay or capture: the buffers' memory is allocated (cheap when it already is)."""
        if self._lent:
            return
        for block in self._blocks.values():
            block.lend()
        self._lent = True

    def give_back(self) -> None:
        """Before a forward: free the buffers' memory unless a tensor handed out on it is still held (then it stays
        allocated, and the backward that next writes it moves that tensor first)."""
        if not self._lent or not self._records:
            return
        if any(r.held() for r in self._records.values()):
            return
        # A group's buffers are all in lent blocks (CUDA with MemPool) or all tensors of their own (see record()).
        for block in self._blocks.values():
            block.memory = None
        if not self._blocks:
            with torch.no_grad():
                for r in self._records.values():
                    if r.static.is_floating_point():
                        r.static.fill_(float("nan"))
        self._lent = False

    def close(self) -> None:
        """The group is going away, and with it the blocks: move every tensor still handed out on them to memory of
        its own, then free each block before its pool. A tensor that cannot be moved (without a storage swap)
        keeps the blocks and their pools for the process's lifetime instead of reading freed memory."""
        # A finalizer: the garbage collector may run it inside a dispatch mode (torch.compile's FakeTensorMode),
        # where the copies would be fake.
        with _disable_current_modes():
            kept = [r.settle_or_keep() for r in self._records.values()]
        if any(kept):
            KEPT_FOR_HOLDERS.extend(self._blocks.values())
            self._blocks = {}
            return
        for block in self._blocks.values():
            block.close()
        self._blocks = {}


# ------------------------------------------------------------------------------------------------ the group's memory
class GroupMemory:
    """The memory state of one capture group, kept by the rules above: the capture numbers and the graphs whose
    backward is pending or retained (part 1), what is handed out (part 3), and a chained stack's grad buffers
    (part 4). Every capture passes :func:`before_capture` first, and every replay :func:`before_replay`."""

    def __init__(self, recorder: Recorder) -> None:
        self.seq = 0  # the newest capture's number: every later capture gets a larger one
        # id(entry) -> (entry, its autograd context): a forward replayed with grad whose backward has not run
        self.in_flight: dict[int, tuple[Entry, weakref.ref]] = {}
        self.retained: dict[int, tuple[Entry, weakref.ref]] = {}  # id(autograd node) -> a backward run retained
        self.handouts = HandoutBook()
        self.chain_buffers = ChainGradBuffers(cuda=recorder.stream is not None)
        # Handed-out views do not keep the graphs' memory allocated: move their holders before it goes.
        weakref.finalize(self, self.handouts.settle_all)
        weakref.finalize(self, self.chain_buffers.close)

    def next_seq(self) -> int:
        """Number a new capture."""
        self.seq += 1
        return self.seq

    def pending(self) -> list[Entry]:
        """The entries whose backward is pending, oldest first; one whose autograd graph was dropped is forgotten
        (its backward will never run)."""
        for key, (_, ref) in list(self.in_flight.items()):
            if ref() is None:
                del self.in_flight[key]
        return [entry for entry, _ in self.in_flight.values()]


# ------------------------------------------------------------------------------------------ before captures and replays
def before_capture(entry: Entry, *, release: bool) -> None:
    """Before a warm-up or capture of ``entry`` allocates from its pool: move handed-out tensors off released memory
    (the allocator may place the capture's tensors there; part 3), mark the retained backwards it may overwrite
    (part 1), and with ``release`` (a forward capture, where a step starts) give back the chained grad buffers
    (part 4) and release the backward results nobody holds (part 3)."""
    recorder, mem = entry.owner.group.recorder, entry.owner.group.memory
    mem.handouts.before_capture(entry.pool)
    if mem.retained:
        overwrite_retained(entry, None, "capture", capture=True)
    if release:
        mem.chain_buffers.give_back()
    unowned = recorder.unowned
    if release and unowned is not None and not recorder.shares_pool and entry.owner.share_activations:
        mem.handouts.release_idle(unowned, mem.seq)


def before_replay(entry: Entry, seq: int | None, what: str) -> None:
    """Before ``entry`` replays its ``what`` graph (``"forward"`` or ``"backward"``, recorded at ``seq``): the order
    check (part 1), then move handed-out tensors this replay may write (part 3)."""
    check_replay_order(entry, seq, what)
    mem = entry.owner.group.memory
    writers = (entry.owner.uid, id(entry))
    if what == "backward":
        # Its own grads and the chained grad buffers it writes (the one of its input grad, and the one its output
        # grad is copied into), not the outputs: only forwards write those.
        bwd = entry.bwd
        chained = [] if bwd is None else [*bwd.chain_records.values(), *bwd.grad_output_records]
        writers = (id(entry), *(r.writer for r in chained))
    else:
        mem.chain_buffers.give_back()  # a forward: the stack's backward is over (or not started)
    mem.handouts.before_replay(seq, writers, entry.pool)
