"""Signature-keyed caches of captured graphs, the recapture policy, and what captures share. Pure Python.

* :class:`GraphCache` holds one callable's captures, keyed by :class:`~packgraph.graphs.signature.CallSignature`:
  a bounded LRU under ``on_mismatch="recapture"``, a single graph under ``on_mismatch="error"`` (a call with
  another signature raises :class:`GraphSignatureError` naming every field that differs). Captures are logged at
  INFO and evictions at WARNING on the ``packgraph.graphs`` logger.
* :class:`CaptureGroup` is what callables captured together share: the recorder (which owns the CUDA memory pool
  and the side stream), the params preparer, the memory state (:class:`~packgraph.graphs.memory.GroupMemory`),
  and the registry of static outputs that lets one graph read another graph's output in place
  (:class:`OutputRegistry`).
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from torch import Tensor

from packgraph.graphs.memory import GroupMemory
from packgraph.graphs.signature import CallSignature, ParamsPreparer, signature_diff
from packgraph.params import PackedSeqParamsError

if TYPE_CHECKING:
    from packgraph.graphs.capture import GraphedCallable
    from packgraph.graphs.entry import Entry
    from packgraph.graphs.recorder import Recorder

__all__ = ["GraphSignatureError", "GraphCache", "OutputRegistry", "CaptureGroup", "ON_MISMATCH", "logger"]

logger = logging.getLogger("packgraph.graphs")

ON_MISMATCH: tuple[str, ...] = ("recapture", "error")

E = TypeVar("E")


class GraphSignatureError(PackedSeqParamsError):
    """A call does not match the static signature a graph was captured for (``on_mismatch="error"``).

    Attributes:
        diffs: ``[(field, captured, given), ...]``, every field that differs.
        field: the differing field names, comma-separated.
    """

    def __init__(self, diffs: list[tuple[str, Any, Any]], *, name: str = "graph") -> None:
        self.diffs = list(diffs)
        self.field = ", ".join(d[0] for d in self.diffs)
        self.rule = "call does not match the captured graph's static signature"
        lines = [f"  {field}: captured {captured!r}, given {given!r}" for field, captured, given in self.diffs]
        self.detail = "\n".join(lines)
        n = len(self.diffs)
        message = (
            f"{name}: the call does not match the captured graph (on_mismatch='error'); "
            f"{n} field{'s' if n != 1 else ''} differ{'s' if n == 1 else ''}:\n{self.detail}\n"
            "Replaying would run a stale graph. Give every call the captured static values (a BucketPolicy via "
            "buckets=... maps batches onto few signatures), or use on_mismatch='recapture'."
        )
        ValueError.__init__(self, message)


class GraphCache(Generic[E]):
    """Captured graphs of one callable, by signature.

    Args:
        max_graphs: LRU bound under ``"recapture"`` (>= 1), or None: no bound, no eviction.
        on_mismatch: ``"recapture"`` or ``"error"``.
        name: used in log lines and errors.
        warn_at: with no bound, warn once when the cache holds more signatures than this.
    """

    def __init__(
        self,
        *,
        max_graphs: int | None = 8,
        on_mismatch: str = "recapture",
        name: str = "graph",
        warn_at: int | None = None,
    ) -> None:
        if on_mismatch not in ON_MISMATCH:
            raise ValueError(f"on_mismatch must be one of {ON_MISMATCH}, got {on_mismatch!r}")
        if max_graphs is not None and max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1 (or None: no bound), got {max_graphs}")
        self.max_graphs = max_graphs
        self.warn_at = warn_at
        self._warned_size = False
        self.on_mismatch = on_mismatch
        self.name = name
        self.captures = 0
        self.evictions = 0
        self._entries: OrderedDict[CallSignature, E] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[CallSignature]:
        return iter(self._entries)

    def values(self) -> list[E]:
        return list(self._entries.values())

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: CallSignature) -> E | None:
        """The graph for ``key`` (marked most recently used), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def check_new(self, key: CallSignature) -> None:
        """Called before capturing for a signature not in the cache.

        Raises:
            GraphSignatureError: under ``on_mismatch="error"`` once a graph exists; names every differing field.
        """
        if self.on_mismatch == "error" and self._entries:
            captured = next(iter(self._entries))
            raise GraphSignatureError(signature_diff(captured, key), name=self.name)

    def insert(self, key: CallSignature, entry: E, *, seconds: float = 0.0, kind: str = "fwd+bwd") -> list[E]:
        """Add a fresh capture; return the entries it replaces (one of the same signature) or evicts to stay within
        ``max_graphs`` (the caller releases them)."""
        previous = next(reversed(self._entries), None)
        replaced = self._entries.pop(key, None)
        self._entries[key] = entry
        self._entries.move_to_end(key)
        self.captures += 1
        if previous is None:
            reason = "first capture"
        elif replaced is not None:
            reason = "a stack capture for a signature it had, replacing that graph"
        else:
            diffs = signature_diff(previous, key)
            reason = "new signature: " + "; ".join(f"{f} {a!r} -> {b!r}" for f, a, b in diffs[:6])
            if len(diffs) > 6:
                reason += f"; and {len(diffs) - 6} more"
        logger.info(
            "%s: captured %s graph #%d (%d cached) in %.1f ms; %s",
            self.name,
            kind,
            self.captures,
            len(self._entries),
            seconds * 1e3,
            reason,
        )
        if self.warn_at is not None and len(self._entries) > self.warn_at and not self._warned_size:
            self._warned_size = True
            logger.warning(
                "%s: %d signatures cached, more than twice the bucket policy's buckets: something besides the "
                "buckets varies between calls (%s). Each is a capture and its memory; keep it fixed if you can.",
                self.name,
                len(self._entries),
                reason,
            )
        evicted = [replaced] if replaced is not None and replaced is not entry else []
        while self.max_graphs is not None and len(self._entries) > self.max_graphs:
            old_key, old = self._entries.popitem(last=False)
            self.evictions += 1
            logger.warning(
                "%s: graph cache full (max_graphs=%d); evicted the least recently used graph (%d evictions so far). "
                "Frequent evictions mean recapture churn: map batches onto few signatures with a BucketPolicy "
                "(buckets=...) or raise max_graphs.",
                self.name,
                self.max_graphs,
                self.evictions,
            )
            evicted.append(old)
        return evicted

    def discard(self, keys: Iterable[CallSignature]) -> list[E]:
        """Drop the entries of ``keys`` (those present); return them (caller releases them)."""
        return [entry for key in list(keys) if (entry := self._entries.pop(key, None)) is not None]

    def clear(self) -> list[E]:
        """Drop every entry; return them (caller releases them)."""
        entries = list(self._entries.values())
        self._entries.clear()
        return entries


class OutputRegistry:
    """Static outputs of captured graphs that another graph may read in place, by ``data_ptr``.

    In a layer stack, layer ``k + 1``'s input is layer ``k``'s output: the very memory layer ``k``'s graph writes.
    Capturing layer ``k + 1`` to read that memory saves a copy per layer per step. The registry hands out a token per
    registered output; the token is part of the consumer's signature, so a call whose input is some other tensor
    gets a graph of its own (copying its input) instead of overwriting the producer's output.
    """

    def __init__(self) -> None:
        self._by_ptr: dict[int, tuple[int, int, weakref.ref[Entry] | None]] = {}
        self._statics: dict[int, Tensor] = {}
        self._tokens = itertools.count(1)

    def registered(self, tensor: Tensor) -> bool:
        """Whether an output starting at ``tensor``'s address is registered (by any graph)."""
        return tensor.data_ptr() in self._by_ptr

    def set_producer(self, tensor: Tensor, producer: Entry) -> None:
        """The graph that wrote the registered output ``tensor`` last at capture (graphs of several signatures of
        one layer share it): the next layer's capture links its backward to that graph's."""
        token, owner, _ = self._by_ptr[tensor.data_ptr()]
        self._by_ptr[tensor.data_ptr()] = (token, owner, weakref.ref(producer))

    def register(self, tensor: Tensor, owner: int, producer: Entry | None = None) -> int:
        """Register ``tensor`` (a static output of ``owner``'s graph ``producer``); return its token."""
        token = next(self._tokens)
        self._by_ptr[tensor.data_ptr()] = (token, owner, None if producer is None else weakref.ref(producer))
        self._statics[tensor.data_ptr()] = tensor
        return token

    def static(self, tensor: Tensor) -> Tensor:
        """The registered output ``tensor`` starts at (the graph's own tensor, where ``tensor`` may be a view
        handed out of it)."""
        return self._statics[tensor.data_ptr()]

    def producer(self, tensor: Tensor) -> Entry | None:
        """The live object registered with the output ``tensor`` starts at, else None."""
        hit = self._by_ptr.get(tensor.data_ptr())
        return None if hit is None or hit[2] is None else hit[2]()

    def unregister(self, tensor: Tensor, token: int) -> None:
        ptr = tensor.data_ptr()
        if self._by_ptr.get(ptr, (None,))[0] == token:
            del self._by_ptr[ptr]
            del self._statics[ptr]

    def lookup(self, tensor: Tensor, owner: int) -> int | None:
        """The token of the registered output ``tensor`` starts at, unless ``owner`` produced it (a graph never
        reads its own output in place), else None."""
        hit = self._by_ptr.get(tensor.data_ptr())
        if hit is None or hit[1] == owner:
            return None
        return hit[0]

    def __len__(self) -> int:
        return len(self._by_ptr)


class CaptureGroup:
    """What callables captured together share.

    Args:
        recorder: warms up and records graphs (``warmup(run, iters)``, ``record(body) -> (graph, results)``),
            owns the memory pool and the side stream; ``device_type`` names the autocast device.
        preparer: the :class:`~packgraph.graphs.signature.ParamsPreparer` (validation, buckets).
        chain: let a graph read another graph's static output in place (layer stacks).

    ``memory`` is the group's memory state (:class:`~packgraph.graphs.memory.GroupMemory`): capture numbers,
    pending and retained backwards, handouts, a chained stack's grad buffers.
    """

    def __init__(self, recorder: Recorder, preparer: ParamsPreparer, *, chain: bool = False) -> None:
        self.recorder = recorder
        self.preparer = preparer
        self.chain = chain
        self.outputs = OutputRegistry() if chain else None
        self.memory = GroupMemory(recorder)
        self._stack: list[weakref.ref[GraphedCallable]] = []
        self._callables: weakref.WeakSet[GraphedCallable] = weakref.WeakSet()

    def add(self, graphed: GraphedCallable) -> None:
        """A callable of the group (a :class:`~packgraph.graphs.capture.GraphedCallable`)."""
        self._callables.add(graphed)

    def callables(self) -> list[GraphedCallable]:
        """The group's callables still alive."""
        return list(self._callables)

    def set_stack(self, callables: list[GraphedCallable]) -> None:
        """The group's callables in the order a chained stack calls them (``capture_layers``)."""
        self._stack = [weakref.ref(c) for c in callables]

    def stack(self) -> list[GraphedCallable]:
        """The chained stack's callables, in order; empty when there is none or one of them is gone."""
        stack = [r() for r in self._stack]
        return stack if all(c is not None for c in stack) else []
