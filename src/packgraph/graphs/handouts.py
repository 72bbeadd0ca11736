"""Static memory handed out of a graph: outputs, input grads and parameter grads that alias the graph's buffers.

A replay writes fixed addresses. The engine hands those addresses to the caller without copies: a forward's outputs
are views of the graph's static outputs, and the grads its backward returns to autograd are views of the backward
graph's static results, which autograd's ``AccumulateGrad`` adopts as ``p.grad`` (or ``x.grad``) when there is none
yet, as eager adopts a fresh grad. Eager would keep each of those tensors unchanged for as long as somebody holds
it; a later replay would not. The :class:`HandoutBook` closes that gap. Before a replay that may write a handed-out
storage, every tensor still holding it is moved, in place and with its data, to memory of its own:

* the tensors the engine created (outputs, grads returned to autograd), by weak reference;
* ``.grad`` of the parameters the grads were returned for, and the tensor ``AccumulateGrad`` adopted as a first
  ``.grad`` (a post-accumulate-grad hook reports it), kept by the caller after ``zero_grad`` or not;

with ``Tensor.set_`` under a preserved version counter, so object identity, values and saved-tensor checks are
those eager would see. A storage still referenced after that (a view the caller made, ``t.detach()`` kept in a
list) cannot be moved: the replay raises :class:`~packgraph.graphs.order.GraphOrderError` instead of overwriting it.

Which replays may write a storage: the graph that owns it (and the other signatures of the same callable, which
share its buffers), and any graph of the same pool captured before the storage was allocated (its temporaries may
lie there). Storages are numbered by the capture that allocated them (``seq``). In the steady state (one backward
per step, ``zero_grad(set_to_none=True)``) nobody holds last step's tensors by the first replay of the next step,
and the check costs one reference count per handed-out storage per step, on the host.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from packgraph.graphs.order import GraphOrderError, preserve_version

__all__ = ["Handout", "HandoutBook"]


def _storage_refs(cdata: int) -> int:
    return torch._C._storage_Use_Count(cdata)


class Handout:
    """One static storage that replays write and callers may receive views of.

    Args:
        static: the graph's tensor (the engine keeps it; its storage is the one tracked).
        seq: the capture number that allocated it.
        owner: uid of the callable whose graphs write it.
        pool: the memory pool it lives in.
        name: used in errors (``"output 0 of layer[3] Block"``).
        params: parameters whose ``.grad`` may adopt a view of it.
    """

    __slots__ = (
        "static",
        "seq",
        "owner",
        "pool",
        "name",
        "params",
        "aliases",
        "cdata",
        "ptr",
        "baseline",
        "out",
    )

    def __init__(
        self, static: Tensor, *, seq: int, owner: int, pool: Any, name: str, params: tuple[Tensor, ...] = ()
    ) -> None:
        self.static = static
        self.seq = seq
        self.owner = owner
        self.pool = pool
        self.name = name
        self.params = params
        self.aliases: list[weakref.ref] = []
        storage = static.untyped_storage()
        self.cdata = storage._cdata
        self.ptr = static.data_ptr()
        self.baseline = _storage_refs(self.cdata)  # the engine's own references, measured before any handout
        self.out = False

    def refs(self) -> int:
        """How many tensors (the engine's and everybody else's) reference the storage now."""
        return _storage_refs(self.cdata)

    def forget_released(self, before: int) -> None:
        """The engine dropped references of its own since ``before`` was read (the autograd graph a capture kept
        for a late backward capture): lower the baseline by as many, so that a caller's view still counts."""
        self.baseline -= max(0, before - self.refs())

    def unpin(self) -> None:
        self.baseline -= 1

    def adopted(self, param: Tensor) -> None:
        """``param``'s ``.grad`` was just set (a post-accumulate-grad hook): track it if it is a view of ours
        (``AccumulateGrad`` adopts a new tensor of its own, which a caller may keep after ``zero_grad``)."""
        g = param.grad
        if self.out and g is not None and g.data_ptr() == self.ptr:
            self.aliases.append(weakref.ref(g))

    def alias(self) -> Tensor:
        """A fresh view of the storage to hand out (tracked until the next replay that may write it)."""
        view = self.static.detach()
        self.aliases.append(weakref.ref(view))
        return view

    def settle(self) -> None:
        """Move every known holder off the storage; raise if an unknown one is left."""
        if _storage_refs(self.cdata) <= self.baseline:
            return
        ptr = self.ptr
        holders: list[Tensor] = [a for a in (ref() for ref in self.aliases) if a is not None]
        holders += [p.grad for p in self.params if p.grad is not None and p.grad.data_ptr() == ptr]
        moved: set[int] = set()
        with torch.no_grad():
            for t in holders:
                if id(t) in moved or t.untyped_storage()._cdata != self.cdata:
                    continue
                moved.add(id(t))
                with preserve_version(t):
                    t.set_(t.clone(memory_format=torch.preserve_format))
        self.aliases.clear()
        if _storage_refs(self.cdata) > self.baseline:
            raise GraphOrderError(
                f"the {self.name} handed out by an earlier call is still referenced by a tensor packgraph cannot "
                "move (a view of it, or a .detach() of it kept somewhere), and this replay would overwrite that "
                "memory. Keep a copy instead (t.clone(), or t.item() for a scalar loss)."
            )


class HandoutBook:
    """The handed-out storages of one capture group, by owner, settled before each replay that may write them.

    Per replay the owner's own records are settled; the others are scanned only when one of them may lie in the
    replayed graph's temporaries (``seq`` at most the newest record's), which in a model's run order happens once
    per step, at its first replay.
    """

    def __init__(self) -> None:
        self._by_owner: dict[int, dict[Handout, None]] = {}
        self._newest = 0  # an upper bound of the seq of every record out

    def hand_out(self, record: Handout) -> Tensor:
        """A view of ``record``'s storage to return to the caller."""
        if not record.out:
            record.out = True
            self._by_owner.setdefault(record.owner, {})[record] = None
            self._newest = max(self._newest, record.seq)
        return record.alias()

    def before_replay(self, seq: int | None, owner: int, pool: Any) -> None:
        """Settle every handed-out storage that a replay of ``owner``'s graph captured at ``seq`` may write."""
        own = self._by_owner.pop(owner, None)
        if own:
            for record in own:
                record.out = False
                record.settle()
        if seq is None or seq > self._newest or not self._by_owner:
            return
        newest = 0
        for other in list(self._by_owner):
            records = self._by_owner[other]
            for record in [r for r in records if r.seq >= seq and r.pool is pool]:
                del records[record]
                record.out = False
                record.settle()
            if records:
                newest = max(newest, max(r.seq for r in records))
            else:
                del self._by_owner[other]
        self._newest = newest

    def forget_owner(self, owner: int) -> None:
        """Drop the records of a callable whose graphs are released (no replay writes their storages again)."""
        for record in self._by_owner.pop(owner, {}):
            record.out = False
