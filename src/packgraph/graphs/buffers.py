"""One set of static buffers per callable, shared by the graphs of all its signatures.

A layer met with several buckets gets one graph set per bucket, but the buffers its graphs read and write on the
forward side have the same shapes in every bucket: the hidden states in and out, the grad of the output.
:class:`SharedBuffers` keeps the first set it sees (the *primary*) and lets every later capture of the same callable
use it: inputs are loaded into the primary's input buffers, and a later graph copies its outputs into the primary's
tensors as its last kernels (a chained next layer reads them in place, whatever the bucket). Backward results
(input and parameter grads) are not shared: each signature writes its own, and they go back to the pool once idle
(:mod:`packgraph.graphs.handouts`), so they cost no second set either and need no zeroing or copy.

Sharing stops where it would be wrong: a buffer of another shape, dtype or stride, or of another ``requires_grad``
(autograd recorded that flag at capture), gets its own tensor; nothing is shared while a graph of the callable is in
flight (its pending backward reads those buffers), and ``share_activations=False`` shares nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from packgraph.graphs.handouts import Handout, unowned_storage
from packgraph.graphs.order import preserve_version

__all__ = ["SharedBuffers", "fits"]


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

    def __init__(self, owner: Any, *, enabled: bool = True) -> None:
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
        """The buffer for ``role`` (an input or a grad-output slot), holding ``like``'s values (zeros with
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
            # An alias that owns nothing: the primary's reference count stays the engine's own (handouts.py).
            alias = unowned_storage(static.untyped_storage())
            with torch.no_grad(), preserve_version(raw):
                raw.set_(alias, static.storage_offset(), static.size(), static.stride())

    def record(self, static: Tensor, *, seq: int, pool: Any, name: str) -> Handout:
        """The :class:`~packgraph.graphs.handouts.Handout` of ``static`` (one per tensor, shared like it)."""
        record = self._records.get(id(static))
        if record is None or record.static is not static:
            record = Handout(static, seq=seq, owner=self.owner.uid, pool=pool, name=name)
            self._records[id(static)] = record
        return record

    def keep_only(self, live: Sequence[Any]) -> None:
        """Forget the records of tensors no live entry holds any more (after evictions)."""
        held = {id(t) for e in live for t in e.statics()}
        self._records = {k: r for k, r in self._records.items() if k in held}

    def clear(self) -> None:
        self.weights_warmed = False
        self._buffers.clear()
        self._results.clear()
        self._records.clear()
