"""Static-metadata buckets: which static ``(max_seqlen, capacity)`` a packed batch runs with.

A captured graph bakes in two values that change with the packing: ``max_seqlen`` (attention kernels size their
launch grid from it) and the capacity (the shape of ``cu_seqlens``). A :class:`BucketPolicy` holds two short ladders
of them; each batch takes the smallest rung of each that fits, so a few graphs serve every batch, and attention does
little more work than at the batch's exact values. :meth:`BucketPolicy.apply` re-pads a batch's params to its bucket
on the device without a host sync, so it can run right before a graph replay.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from packgraph import slot_boundary
from packgraph.params import DYNAMIC_FIELDS, PackedSeqParams

__all__ = ["Bucket", "BucketPolicy", "default_buckets", "document_mask_buckets", "geometric_ladder"]

_REAL_FIELDS = ("cu_seqlens_q", "cu_seqlens_kv")


@dataclass(frozen=True, order=True)
class Bucket:
    """A static ``(max_seqlen, capacity)`` pair: one graph signature's share of the packing."""

    max_seqlen: int
    capacity: int

    def __str__(self) -> str:
        return f"max_seqlen={self.max_seqlen} capacity={self.capacity}"


@dataclass(frozen=True)
class BucketPolicy:
    """Two ladders of static values; a batch runs with the smallest rung of each that fits it.

    Args:
        max_seqlen_ladder: allowed static ``max_seqlen`` values, strictly increasing positive ints.
        capacity_ladder: allowed capacities (``cu_seqlens`` slots), strictly increasing positive ints.
        flash_kernels: the layers run FlashAttention (``varlen_attention``'s ``"flash"`` backend, the default).
            ``False`` for the document-mask backend, whose kernel does not switch with the slot count.
        short_docs_min_slots: from how many slots causal self-attention runs short_docs (``None``: never;
            :mod:`packgraph.slot_boundary`), stamped on every params :meth:`apply` returns.

    The number of buckets (hence of graphs a training run may capture) is the product of the ladder lengths.
    With ``short_docs_min_slots = m``, a capacity ladder with rungs of ``m`` or more gets a rung of ``m - 1`` when it
    lacks one (:func:`~packgraph.slot_boundary.with_boundary_rung`), so that no bucket holds batches on both sides
    of the attention kernel's switch; unless ``flash_kernels`` is ``False``.
    """

    max_seqlen_ladder: tuple[int, ...]
    capacity_ladder: tuple[int, ...]
    flash_kernels: bool = True
    short_docs_min_slots: int | None = slot_boundary.DEFAULT_MIN_SLOTS

    def __post_init__(self) -> None:
        slot_boundary.check_min_slots(self.short_docs_min_slots, "BucketPolicy.short_docs_min_slots")
        for name in ("max_seqlen_ladder", "capacity_ladder"):
            ladder = tuple(getattr(self, name))
            if not ladder:
                raise ValueError(f"BucketPolicy.{name} must not be empty")
            if any(isinstance(v, bool) or not isinstance(v, int) for v in ladder):
                raise ValueError(f"BucketPolicy.{name} must hold Python ints, got {ladder}")
            if ladder[0] < 1:
                raise ValueError(f"BucketPolicy.{name} must be positive, got {ladder}")
            if any(b <= a for a, b in zip(ladder, ladder[1:], strict=False)):
                raise ValueError(f"BucketPolicy.{name} must be sorted and unique (strictly increasing), got {ladder}")
            if name == "capacity_ladder" and self.flash_kernels:
                ladder = slot_boundary.with_boundary_rung(ladder, self.short_docs_min_slots)
            object.__setattr__(self, name, ladder)

    @property
    def num_buckets(self) -> int:
        """How many distinct buckets (static signatures) the policy can produce."""
        return len(self.max_seqlen_ladder) * len(self.capacity_ladder)

    @property
    def max_capacity(self) -> int:
        """The largest capacity rung: a packer must put at most this many documents in a bin."""
        return self.capacity_ladder[-1]

    @property
    def max_seqlen(self) -> int:
        """The largest max_seqlen rung: no document may be longer."""
        return self.max_seqlen_ladder[-1]

    def buckets(self) -> list[Bucket]:
        """Every bucket, ordered by max_seqlen then capacity."""
        return [Bucket(s, c) for s in self.max_seqlen_ladder for c in self.capacity_ladder]

    def describe(self) -> str:
        """One line: the ladders and the bucket count."""
        return (
            f"BucketPolicy: max_seqlen in {self.max_seqlen_ladder} x capacity in {self.capacity_ladder} "
            f"= {self.num_buckets} buckets"
        )

    def bucket_for(self, max_seqlen: int, num_seqs: int) -> Bucket:
        """The smallest bucket with ``bucket.max_seqlen >= max_seqlen`` and ``bucket.capacity >= num_seqs``.

        Args:
            max_seqlen: the batch's true longest sequence (>= 0).
            num_seqs: the number of slots the batch uses (>= 0).

        Raises:
            ValueError: nothing fits; the message says which ladder to extend or what to cap.
        """
        if max_seqlen < 0 or num_seqs < 0:
            raise ValueError(f"max_seqlen and num_seqs must be >= 0, got {max_seqlen}, {num_seqs}")
        seqlen = next((v for v in self.max_seqlen_ladder if v >= max_seqlen), None)
        if seqlen is None:
            raise ValueError(
                f"no bucket fits max_seqlen={max_seqlen}: the largest max_seqlen rung is {self.max_seqlen}; add a "
                f"rung >= {max_seqlen} or truncate documents to {self.max_seqlen} tokens"
            )
        capacity = next((v for v in self.capacity_ladder if v >= num_seqs), None)
        if capacity is None:
            raise ValueError(
                f"no bucket fits {num_seqs} sequences: the largest capacity rung is {self.max_capacity}; add a rung "
                f">= {num_seqs} or pack with max_seqs_per_bin <= {self.max_capacity}"
            )
        return Bucket(seqlen, capacity)

    def bucket_of(self, params: PackedSeqParams) -> Bucket:
        """The bucket ``params`` belong in (see :meth:`apply` for where the true values come from)."""
        max_seqlen, num_seqs, _ = _true_extent(params)
        return self.bucket_for(max_seqlen, self._slots(params.capacity, num_seqs))

    def _slots(self, capacity: int, num_seqs: int) -> int:
        if not self.flash_kernels:
            return num_seqs
        return slot_boundary.bucket_slots(capacity, num_seqs, self.short_docs_min_slots)

    def apply(self, params: PackedSeqParams) -> PackedSeqParams:
        """Return ``params`` re-padded to their bucket: graph-safe, no host sync.

        * The true longest sequence and number of used slots are read from ``params.host_offsets`` (host copies,
          no sync) when they are current (:meth:`~packgraph.params.PackedSeqParams.current_host_offsets`: on the
          CPU that includes their values). Trailing zero-length slots count as ghosts and may be dropped, but not
          below ``short_docs_min_slots`` when it is set. Without current host offsets
          the params' own static ``max(max_seqlen_q, max_seqlen_kv)`` and ``capacity`` are taken as the bound, so
          the capacity only grows. On a GPU, offsets written behind the version counter (``.data``, DLPack) leave
          the old copies current, and slots they fill past the old last document would be sliced away: rebuild the
          params after such a write, or drop their host offsets.
        * Every ``cu_seqlens*`` tensor is resized to ``capacity + 1`` entries with device ops only: extended by
          repeating its last offset (ghost slots) or sliced (the result may share storage with the input).
          Tensors shared between fields stay shared.
        * ``short_docs_min_slots`` is set to the policy's.
        * ``max_seqlen_q`` and ``max_seqlen_kv`` are set to the bucket's static value; ``host_offsets`` are
          resized to match; a present ``seq_idx`` is re-derived on the device so its tail value follows the new
          capacity.

        Raises:
            ValueError: no bucket fits (see :meth:`bucket_for`).
        """
        max_seqlen, num_seqs, host = _true_extent(params)
        bucket = self.bucket_for(max_seqlen, self._slots(params.capacity, num_seqs))
        resized: dict[int, Tensor] = {}
        changes: dict[str, Any] = {}
        for name in DYNAMIC_FIELDS:
            t = getattr(params, name)
            if t is None:
                continue
            if id(t) not in resized:
                resized[id(t)] = _resize_offsets(t, bucket.capacity)
            changes[name] = resized[id(t)]
        new_host = None
        if host is not None:
            new_host = {name: _resize_host(offs, bucket.capacity) for name, offs in host.items()}
        out = params.replace(
            max_seqlen_q=bucket.max_seqlen,
            max_seqlen_kv=bucket.max_seqlen,
            host_offsets=new_host,
            short_docs_min_slots=self.short_docs_min_slots,
            **changes,
        )
        if out.seq_idx is not None:
            out = out.with_seq_idx()
        return out

    def stats(self, batches: Iterable[Any]) -> dict[Bucket, int]:
        """How many batches run in each bucket.

        ``batches`` holds objects with a ``packed_seq_params`` attribute (e.g. ``PackedBatch``) or params
        themselves; each is counted under its *static* ``(max_seqlen_q, capacity)``. The result lists every
        bucket of the policy in :meth:`buckets` order (zero counts included), then any off-policy bucket seen.
        """
        counts: dict[Bucket, int] = dict.fromkeys(self.buckets(), 0)
        for item in batches:
            params = getattr(item, "packed_seq_params", item)
            key = Bucket(params.max_seqlen_q, params.capacity)
            counts[key] = counts.get(key, 0) + 1
        return counts


def default_buckets(total_tokens: int) -> BucketPolicy:
    """The default policy for batches of ``total_tokens`` rows. It accepts every batch of at most ``total_tokens``
    documents of at most ``total_tokens`` tokens each.

    * max_seqlen: ``256, 1024, 4096, ...`` (x4) below ``total_tokens``, then ``total_tokens`` itself (a document
      can never be longer than the batch);
    * capacity: ``8, 32, 128, 512, 2048, ...`` (x4) below ``total_tokens``, then ``total_tokens`` itself (the most
      documents ``total_tokens`` rows can hold, one token each). Rungs past 512 serve only batches of that many
      documents; a graph is captured for one only when such a batch comes. Up to ``total_tokens = 2048`` the
      ladder starts with a rung of 1: a lone document there fills less than one wave of FlashAttention blocks,
      and ghost slots' empty blocks, interleaved with its own, slow it down.

    Both ladders stay close to the batch because FlashAttention's grid grows with both (a ghost slot, or a rung of
    max_seqlen slack, is empty blocks). The measurements behind the rungs are in ``docs/buckets.md``.
    """
    if total_tokens < 1:
        raise ValueError(f"total_tokens must be >= 1, got {total_tokens}")
    capacities = geometric_ladder(8, total_tokens, 4)
    if 1 < total_tokens <= _LONE_DOCUMENT_RUNG_UP_TO:
        capacities = (1, *capacities)
    return BucketPolicy(geometric_ladder(256, total_tokens, 4), capacities)


def document_mask_buckets(total_tokens: int) -> BucketPolicy:
    """One bucket for every batch of ``total_tokens`` rows, for layers on the document-mask attention backend
    (``varlen_attention(..., backend="doc_mask")``): its launch depends on ``T`` only, so the largest rungs cost it
    nothing, and a layer needs one graph for every packing. ``max_seqlen`` is ``total_tokens`` and the capacity
    too (the most documents ``total_tokens`` rows can hold, one token each)."""
    if total_tokens < 1:
        raise ValueError(f"total_tokens must be >= 1, got {total_tokens}")
    return BucketPolicy((total_tokens,), (total_tokens,), flash_kernels=False)


# The largest T whose single-document batches get a capacity rung of their own. docs/buckets.md: at T=2048 a lone
# document runs FA2 29% faster forward and 12% faster backward at capacity 1 than at 8; at T=4096 and 8192 only the
# backward gains (4-7%), and the rung would cost a graph (and a torch.compile recompile) per max_seqlen rung.
_LONE_DOCUMENT_RUNG_UP_TO = 2048


def geometric_ladder(start: int, top: int, factor: int) -> tuple[int, ...]:
    """``start, start * factor, ...`` below ``top``, then ``top`` itself: ``(256, 1024, 2048)`` for
    ``(256, 2048, 4)``; ``(top,)`` when ``start >= top``."""
    rungs = []
    rung = start
    while rung < top:
        rungs.append(rung)
        rung *= factor
    return (*rungs, top)


def _true_extent(params: PackedSeqParams) -> tuple[int, int, dict[str, Sequence[int]] | None]:
    """``(max_seqlen, num_used_slots, host_offsets or None)``, from host offsets when they cover every field."""
    present = [name for name in DYNAMIC_FIELDS if getattr(params, name) is not None]
    host = params.current_host_offsets()
    if host is None or any(name not in host for name in present):
        bound = max(v for v in (params.max_seqlen_q, params.max_seqlen_kv) if v is not None)
        return bound, params.capacity, None
    host = {name: tuple(host[name]) for name in present}
    longest, used = 0, 0
    for name, offs in host.items():
        lengths = [b - a for a, b in zip(offs, offs[1:], strict=False)]
        if name in _REAL_FIELDS:
            longest = max(longest, max(lengths, default=0))
        # A slot is used if it covers any row, real or padding; trailing empty slots are ghosts.
        used = max(used, next((i + 1 for i in range(len(lengths) - 1, -1, -1) if lengths[i] > 0), 0))
    return longest, used, host


def _resize_offsets(offsets: Tensor, capacity: int) -> Tensor:
    n = capacity + 1
    if offsets.numel() == n:
        return offsets
    if offsets.numel() > n:
        return offsets[:n]
    # expand of the last element: ghost slots repeat the last offset, computed on the device (no .item()).
    return torch.cat([offsets, offsets[-1:].expand(n - offsets.numel())])


def _resize_host(offsets: Sequence[int], capacity: int) -> tuple[int, ...]:
    n = capacity + 1
    offsets = tuple(offsets)
    return offsets[:n] if len(offsets) >= n else offsets + (offsets[-1],) * (n - len(offsets))
