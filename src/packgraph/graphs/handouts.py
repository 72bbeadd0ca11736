"""Static memory handed out of a graph: outputs, input grads and parameter grads that alias the graph's buffers.

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
:class:`~packgraph.graphs.order.GraphOrderError` rather than overwrite it; so the grads of inputs, which autograd
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
not see their captures). A chained stack's two hidden-state grad buffers are records too, written by every layer's
backward of their slot: each such backward settles what is handed out on the slot it writes.

A handle does not keep the graph's memory allocated, so every handle still held is settled before the engine lets
go of a storage: when a graph is evicted or dropped, and when its capture group is collected.
"""

from __future__ import annotations

import gc
import math
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from packgraph.graphs.order import GraphOrderError, preserve_version

__all__ = ["Handout", "HandoutBook", "unowned_storage", "COPIED_OUTPUT_BYTES", "KEPT_FOR_HOLDERS", "SWAP_DATA_PTR"]

SWAP_DATA_PTR = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
"""Whether this torch can move every holder of a storage at once (else holders are moved one by one, and the
grads of inputs, which autograd may keep out of Python's reach, are handed out as copies)."""

scans = 0
"""Scans of the garbage collector's objects made so far (see the module docstring)."""

KEPT_FOR_HOLDERS: list[Any] = []
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
        owner: who writes it at every replay: the callable's uid for a buffer all its signatures share (outputs),
            or one entry's for a signature's own (grads).
        pool: the memory pool it lives in.
        name: used in log lines and errors (``"output 0 of layer[3] Block"``).
    """

    __slots__ = (
        "static", "seq", "owner", "pool", "name", "params", "out", "released_at", "aliases", "_handle", "_cdata",
        "_baseline", "__weakref__",
    )  # fmt: skip

    def __init__(
        self, static: Tensor, *, seq: int, owner: Any, pool: Any, name: str, params: tuple[Tensor, ...] = ()
    ) -> None:
        self.static = static
        self.seq = seq
        self.owner = owner
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
        copy = torch.UntypedStorage(storage.nbytes(), device=storage.device)
        copy.copy_(storage)
        if SWAP_DATA_PTR:
            storage._swap_data_ptr_(copy)  # the holders own the copy now; ``copy`` is left with the unowned memory
            return
        self._move_onto(copy, handle, [*known, *(p.grad for p in self.params)])
        if _storage_refs(self._cdata) > self._baseline:  # the baseline counts ``handle`` itself
            global scans
            scans += 1
            self._move_onto(copy, handle, (o for o in gc.get_objects() if isinstance(o, Tensor)))
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

    def _move_onto(self, copy: torch.UntypedStorage, handle: Tensor, holders: Any) -> None:
        with torch.no_grad():
            for t in holders:
                if t is None or t is handle or not _on_storage(t, self._cdata):
                    continue
                with preserve_version(t):
                    t.set_(copy, t.storage_offset(), t.size(), t.stride())

    def release(self, unowned: Any, seq: int) -> bool:
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
    """The handed-out storages of one capture group, by owner, settled before each replay that may write them.

    Per replay the owner's own records are settled; the others are scanned only when one of them may lie in the
    replayed graph's memory (:meth:`Handout.exposed_to`), which in a model's run order happens once per step, at
    its first replay.
    """

    def __init__(self) -> None:
        self._by_owner: dict[Any, dict[Handout, None]] = {}
        self._newest = 0  # an upper bound of the seq of every record out
        self._first_release = math.inf  # a lower bound of released_at of every released record out
        self._releasable: dict[int, weakref.ref] = {}  # backward results, released when idle

    def hand_out(self, record: Handout) -> Tensor:
        """A view of ``record``'s storage to return to the caller."""
        if not record.out:
            record.out = True
            self._by_owner.setdefault(record.owner, {})[record] = None
            self._newest = max(self._newest, record.seq)
            if record.released_at is not None:
                self._first_release = min(self._first_release, record.released_at)
        return record.alias()

    def before_replay(self, seq: int | None, owners: tuple[Any, ...], pool: Any) -> None:
        """Settle every handed-out storage that a replay of a graph captured at ``seq`` may write: the ones of its
        ``owners`` (the callable's shared buffers, the entry's own, the chained grad buffer it writes), and the
        others that :meth:`Handout.exposed_to` names."""
        for owner in owners:
            self.settle_owner(owner)
        if seq is None or not self._by_owner or self._newest < seq <= self._first_release:
            return
        self._settle_others(lambda r: r.pool is pool and r.exposed_to(seq))

    def settle_owner(self, owner: Any) -> None:
        """Settle every handed-out storage that ``owner`` writes (before its replay, or a capture that writes it)."""
        for record in self._by_owner.pop(owner, None) or ():
            record.out = False
            record.settle()

    def before_capture(self, pool: Any) -> None:
        """Settle every released storage of ``pool`` still handed out: the capture may allocate its memory."""
        if self._by_owner and self._first_release < math.inf:
            self._settle_others(lambda r: r.pool is pool and r.released_at is not None)

    def _settle_others(self, exposed: Any, *, letting_go: bool = False) -> None:
        newest, first_release = 0, math.inf
        for other in list(self._by_owner):
            records = self._by_owner[other]
            for record in [r for r in records if exposed(r)]:
                del records[record]
                record.out = False
                record.settle_or_keep() if letting_go else record.settle()
            if not records:
                del self._by_owner[other]
                continue
            newest = max(newest, max(r.seq for r in records))
            released = [r.released_at for r in records if r.released_at is not None]
            first_release = min([first_release, *released])
        self._newest, self._first_release = newest, first_release

    def track(self, record: Handout) -> None:
        """``record`` holds a backward graph's result: :meth:`release_idle` may release it."""
        self._releasable[id(record)] = weakref.ref(record)

    def release_idle(self, unowned: Any, seq: int) -> int:
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
                    self._by_owner.get(record.owner, {}).pop(record, None)
        return released

    def forget_owner(self, owner: Any) -> None:
        """Settle and drop the records of a graph the engine lets go of (evicted, or captured for parameters that
        moved): a handle does not keep the memory allocated, and no replay writes it for its holders any more."""
        for record in self._by_owner.pop(owner, {}):
            record.out = False
            record.settle_or_keep()

    def settle_all(self) -> None:
        """Move every holder of a handed-out storage to memory of its own: the group is going away, and with it the
        graphs' memory."""
        # A finalizer: the garbage collector may run it inside any dispatch mode (torch.compile's FakeTensorMode,
        # while it traces), where the copies would be fake and the holders left on memory the pool gives back.
        with _disable_current_modes():
            self._settle_others(lambda r: True, letting_go=True)
