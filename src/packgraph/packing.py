"""Bin packing of documents into fixed-size token streams, and fixed-shape packed batches.

Two steps turn a corpus into graph-ready batches:

1. :func:`pack_sequences` assigns documents to bins of ``bin_size`` rows (first-, best- or next-fit decreasing).
2. :meth:`PackedBatch.from_documents` lays one bin out as a THD stream of exactly ``bin_size`` rows with
   ``capacity`` ``cu_seqlens`` slots, so every batch of one bucket has the same shapes and static signature.

:func:`batches_from_corpus` chains both with a :class:`~packgraph.buckets.BucketPolicy`;
:func:`fixed_shape_sample` builds the sample batch a capture uses.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from packgraph.data.corpus import PAD_ID
from packgraph.params import PackedSeqParams, StaticSignature

if TYPE_CHECKING:
    from packgraph.buckets import Bucket, BucketPolicy

__all__ = [
    "IGNORE_INDEX",
    "PACKING_ALGORITHMS",
    "CorpusBatches",
    "PackedBatch",
    "Packing",
    "batches_from_corpus",
    "fixed_shape_sample",
    "pack_sequences",
]

IGNORE_INDEX: int = -100
"""Label of rows with no next-token target (``torch.nn.functional.cross_entropy``'s default ignore index)."""

PACKING_ALGORITHMS: tuple[str, ...] = ("ffd", "bfd", "nfd")


# ---------------------------------------------------------------------------------------------- bin packing
class Packing(list):
    """Bins of document indices (a ``list[list[int]]``), with what the packer decided.

    Attributes:
        bin_size: rows per bin.
        lengths: effective length of every document (after truncation), indexed like the input.
        truncated: indices of documents that were truncated to fit a bin, ascending.
        efficiency: real tokens / (number of bins * bin_size); 0.0 when there are no bins.
        algorithm: ``"ffd"``, ``"bfd"`` or ``"nfd"``.
        multiple: each document's footprint in a bin is its length rounded up to this.
        max_seqs_per_bin: the document-count limit the bins respect.

    Within a bin, indices are ascending (corpus order); bins are in the order the packer opened them.
    """

    def __init__(
        self,
        bins: Sequence[list[int]],
        *,
        bin_size: int,
        lengths: Sequence[int],
        truncated: Sequence[int],
        algorithm: str,
        multiple: int,
        max_seqs_per_bin: int,
    ) -> None:
        super().__init__(bins)
        self.bin_size = bin_size
        self.lengths = tuple(lengths)
        self.truncated = tuple(truncated)
        self.algorithm = algorithm
        self.multiple = multiple
        self.max_seqs_per_bin = max_seqs_per_bin
        slots = len(self) * bin_size
        self.efficiency = sum(self.lengths) / slots if slots else 0.0

    def __repr__(self) -> str:
        return (
            f"Packing({len(self)} bins of {self.bin_size}, {len(self.lengths)} docs, "
            f"efficiency={self.efficiency:.4f}, algorithm={self.algorithm!r}, truncated={len(self.truncated)})"
        )


def pack_sequences(
    lengths: Sequence[int] | Tensor,
    bin_size: int,
    *,
    max_seqs_per_bin: int,
    multiple: int = 1,
    algorithm: str = "ffd",
    overlong: str = "raise",
) -> Packing:
    """Assign documents to bins of ``bin_size`` rows.

    Each document takes ``ceil(len / multiple) * multiple`` rows of its bin (its padded footprint, matching
    ``PackedSeqParams.from_seqlens(pad_to_multiple=multiple)``). A bin holds at most ``max_seqs_per_bin``
    documents and at most ``bin_size`` rows of footprint. Zero-length documents take a slot but no rows.

    Algorithms (documents visited longest footprint first, ties by index, so the result is deterministic):

    * ``"ffd"`` first-fit decreasing: the first bin with room (O(n log n) with a max-tree over bins).
    * ``"bfd"`` best-fit decreasing: the bin with the least room that still fits (ties: lowest bin).
    * ``"nfd"`` next-fit decreasing: only the newest bin is open; when the document does not fit, open another
      (Megatron RL's behaviour; simple, usually more bins).

    Args:
        lengths: host-side document lengths (ints >= 0, or a CPU tensor).
        overlong: a document whose footprint exceeds ``bin_size``: ``"raise"`` a ``ValueError`` naming the
            indices, or ``"truncate"`` it to the longest length whose footprint fits (listed in
            ``Packing.truncated``). Documents are never dropped.

    Raises:
        ValueError: bad arguments, or an overlong document with ``overlong="raise"``.
    """
    if isinstance(lengths, Tensor):
        lengths = lengths.tolist()
    lengths = [int(n) for n in lengths]
    if algorithm not in PACKING_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {PACKING_ALGORITHMS}, got {algorithm!r}")
    if overlong not in ("raise", "truncate"):
        raise ValueError(f"overlong must be 'raise' or 'truncate', got {overlong!r}")
    if max_seqs_per_bin < 1 or multiple < 1:
        raise ValueError(f"max_seqs_per_bin and multiple must be >= 1, got {max_seqs_per_bin}, {multiple}")
    if bin_size < multiple:
        raise ValueError(f"bin_size ({bin_size}) must be >= multiple ({multiple}): no document would fit")
    negative = [i for i, n in enumerate(lengths) if n < 0]
    if negative:
        raise ValueError(f"document lengths must be >= 0; negative at indices {negative[:20]}")

    # The longest length whose padded footprint fits one bin.
    longest_fit = (bin_size // multiple) * multiple
    truncated = [i for i, n in enumerate(lengths) if n > longest_fit]
    if truncated and overlong == "raise":
        shown = ", ".join(f"{i} (len {lengths[i]})" for i in truncated[:20])
        more = f" and {len(truncated) - 20} more" if len(truncated) > 20 else ""
        raise ValueError(
            f"{len(truncated)} documents do not fit a bin of {bin_size} rows (multiple={multiple}): {shown}{more}; "
            f"pass overlong='truncate' or a larger bin_size"
        )
    effective = [min(n, longest_fit) for n in lengths]
    footprints = [-(-n // multiple) * multiple for n in effective]
    order = sorted(range(len(effective)), key=lambda i: (-footprints[i], i))
    fit = {"ffd": _first_fit, "bfd": _best_fit, "nfd": _next_fit}[algorithm]
    bins = fit(order, footprints, bin_size, max_seqs_per_bin)
    return Packing(
        [sorted(b) for b in bins],
        bin_size=bin_size,
        lengths=effective,
        truncated=truncated,
        algorithm=algorithm,
        multiple=multiple,
        max_seqs_per_bin=max_seqs_per_bin,
    )


def _first_fit(order: list[int], footprints: list[int], bin_size: int, max_seqs: int) -> list[list[int]]:
    # Max-tree over (at most n) bins of their free rows, -1 once a bin holds max_seqs documents. Unopened bins
    # read as empty (bin_size free), so "leftmost leaf with enough room" opens a new bin exactly when first-fit
    # would: O(log n) per document instead of a scan over every bin.
    size = 1
    while size < max(len(order), 1):
        size *= 2
    tree = [bin_size] * (2 * size)
    bins: list[list[int]] = []
    for i in order:
        need = footprints[i]
        node = 1
        while node < size:
            node = 2 * node if tree[2 * node] >= need else 2 * node + 1
        leaf = node - size
        if leaf == len(bins):
            bins.append([])
        bins[leaf].append(i)
        tree[node] = tree[node] - need if len(bins[leaf]) < max_seqs else -1
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return bins


def _best_fit(order: list[int], footprints: list[int], bin_size: int, max_seqs: int) -> list[list[int]]:
    # Open bins (fewer than max_seqs documents) sorted by (free rows, bin index): bisect finds the tightest fit,
    # lowest bin first among equals.
    open_bins: list[tuple[int, int]] = []
    bins: list[list[int]] = []
    for i in order:
        need = footprints[i]
        pos = bisect.bisect_left(open_bins, (need, -1))
        if pos < len(open_bins):
            free, b = open_bins.pop(pos)
        else:
            free, b = bin_size, len(bins)
            bins.append([])
        bins[b].append(i)
        if len(bins[b]) < max_seqs:
            bisect.insort(open_bins, (free - need, b))
    return bins


def _next_fit(order: list[int], footprints: list[int], bin_size: int, max_seqs: int) -> list[list[int]]:
    bins: list[list[int]] = []
    free = 0
    for i in order:
        need = footprints[i]
        if not bins or need > free or len(bins[-1]) >= max_seqs:
            bins.append([])
            free = bin_size
        bins[-1].append(i)
        free -= need
    return bins


# ---------------------------------------------------------------------------------------------- batches
@dataclass(eq=False)  # tensor fields: == would be elementwise, not a bool
class PackedBatch:
    """One fixed-shape packed batch: ``T = bin_size`` rows in THD layout.

    Fields (all ``[T]``, on one device):
        tokens: int64 token ids; ``pad_id`` on rows that belong to no document.
        labels: int64 next token *within the same document*; :data:`IGNORE_INDEX` (-100) on each document's last
            token, on padding rows and on tail rows, so no target ever crosses a document boundary.
        loss_mask: float32, 1.0 where ``labels != -100``, else 0.0.
        position_ids: int64 position within the document (0 at each document start); 0 on dead rows.
        packed_seq_params: :class:`PackedSeqParams` with ``total_tokens = T``, ``capacity`` slots, static
            ``max_seqlen``, and ``host_offsets`` set (validation and bucketing need no sync).
        doc_lengths: host-side lengths of the documents in stream order (not tensors; not part of the shape).

    Static for a given (T, capacity, max_seqlen, pad_to_multiple, device): every tensor shape and
    ``packed_seq_params.static_signature()``. Rows past the last offset (tail) and padding rows are dead: the ops
    zero them and they carry no loss.
    """

    tokens: Tensor
    labels: Tensor
    loss_mask: Tensor
    position_ids: Tensor
    packed_seq_params: PackedSeqParams
    doc_lengths: tuple[int, ...] | None = None

    @classmethod
    def from_documents(
        cls,
        docs: Sequence[Tensor | Sequence[int]],
        *,
        bin_size: int,
        capacity: int,
        max_seqlen: int | None = None,
        pad_to_multiple: int = 1,
        pad_id: int = PAD_ID,
    ) -> PackedBatch:
        """Lay ``docs`` (1-D int token sequences) out in one stream of ``bin_size`` rows, on the CPU.

        Document ``i`` starts at row ``cu_seqlens_q_padded[i]`` when ``pad_to_multiple > 1`` (each document padded
        to a multiple), else at ``cu_seqlens_q[i]``. Slots past ``len(docs)`` are ghosts.

        Args:
            max_seqlen: static max seqlen; ``None`` means ``bin_size`` (always valid, so the signature does not
                depend on the documents; pass a bucket's value for faster attention).

        Raises:
            ValueError: the documents need more than ``bin_size`` rows, more than ``capacity`` slots, or one is
                longer than ``max_seqlen`` (a ``PackedSeqParamsError`` naming the field).
        """
        if pad_to_multiple < 1:
            raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
        tensors = [_as_tokens(d) for d in docs]
        lengths = [int(t.numel()) for t in tensors]
        footprint = sum(-(-n // pad_to_multiple) * pad_to_multiple for n in lengths)
        if footprint > bin_size:
            raise ValueError(
                f"{len(docs)} documents need {footprint} rows (pad_to_multiple={pad_to_multiple}) but bin_size is "
                f"{bin_size}; pack them with pack_sequences first"
            )
        params = PackedSeqParams.from_seqlens(
            lengths,
            capacity=capacity,
            total_tokens=bin_size,
            pad_to_multiple=pad_to_multiple,
            max_seqlen=bin_size if max_seqlen is None else max_seqlen,
        )
        host = params.host_offsets
        starts = host.get("cu_seqlens_q_padded", host["cu_seqlens_q"])[: len(lengths)]
        tokens = torch.full((bin_size,), pad_id, dtype=torch.int64)
        labels = torch.full((bin_size,), IGNORE_INDEX, dtype=torch.int64)
        position_ids = torch.zeros(bin_size, dtype=torch.int64)
        n_real = sum(lengths)
        if n_real:
            flat = torch.cat(tensors)
            len_t = torch.tensor(lengths, dtype=torch.int64)
            doc_of = torch.repeat_interleave(torch.arange(len(lengths)), len_t)
            real_start = torch.tensor(host["cu_seqlens_q"][: len(lengths)], dtype=torch.int64)
            pos = torch.arange(n_real, dtype=torch.int64) - real_start[doc_of]
            rows = torch.tensor(starts, dtype=torch.int64)[doc_of] + pos
            # The target of token j is token j + 1 of the same document; a document's last token has none.
            next_token = torch.cat([flat[1:], flat.new_full((1,), IGNORE_INDEX)])
            is_last = pos == len_t[doc_of] - 1
            tokens[rows] = flat
            labels[rows] = torch.where(is_last, torch.full_like(next_token, IGNORE_INDEX), next_token)
            position_ids[rows] = pos
        return cls(
            tokens=tokens,
            labels=labels,
            loss_mask=(labels != IGNORE_INDEX).to(torch.float32),
            position_ids=position_ids,
            packed_seq_params=params,
            doc_lengths=tuple(lengths),
        )

    # ------------------------------------------------------------------ views
    @property
    def total_tokens(self) -> int:
        """``T``, the number of rows (static; equals the ``bin_size`` the batch was built with)."""
        return self.tokens.shape[0]

    @property
    def capacity(self) -> int:
        """Number of ``cu_seqlens`` slots (static)."""
        return self.packed_seq_params.capacity

    @property
    def max_seqlen(self) -> int:
        """The static ``max_seqlen_q``."""
        return self.packed_seq_params.max_seqlen_q

    @property
    def num_docs(self) -> int:
        """Number of documents (host int). Needs ``doc_lengths``."""
        if self.doc_lengths is None:
            raise ValueError("num_docs needs doc_lengths (set by from_documents)")
        return len(self.doc_lengths)

    @property
    def num_real_tokens(self) -> int:
        """Rows with a loss target (host int). From ``doc_lengths`` when known, else one device read of
        ``loss_mask`` (a sync on CUDA)."""
        if self.doc_lengths is not None:
            return sum(max(n - 1, 0) for n in self.doc_lengths)
        return int(self.loss_mask.sum().item())

    def static_signature(self) -> StaticSignature:
        """The params' static signature; with ``T`` in it, it fixes every tensor shape of the batch too."""
        return self.packed_seq_params.static_signature()

    @property
    def bucket(self) -> Bucket:
        """The static ``(max_seqlen, capacity)`` this batch runs with."""
        from packgraph.buckets import Bucket

        return Bucket(self.max_seqlen, self.capacity)

    # ------------------------------------------------------------------ moves
    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """A copy on ``device`` (host offsets and ``doc_lengths`` are kept)."""
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in fields(self)
            if f.name != "doc_lengths"
        }
        return PackedBatch(**moved, doc_lengths=self.doc_lengths)

    def pin_memory(self) -> PackedBatch:
        """A copy with page-locked CPU tensors, so ``.to("cuda", non_blocking=True)`` is truly asynchronous."""
        params = self.packed_seq_params
        pinned: dict[int, Tensor] = {}
        changes = {}
        for name, t in params.graph_inputs().items():
            if id(t) not in pinned:
                pinned[id(t)] = t.pin_memory()
            changes[name] = pinned[id(t)]
        return PackedBatch(
            tokens=self.tokens.pin_memory(),
            labels=self.labels.pin_memory(),
            loss_mask=self.loss_mask.pin_memory(),
            position_ids=self.position_ids.pin_memory(),
            packed_seq_params=params.replace(host_offsets=params.current_host_offsets(), **changes),
            doc_lengths=self.doc_lengths,
        )


def _as_tokens(doc: Tensor | Sequence[int]) -> Tensor:
    t = doc if isinstance(doc, Tensor) else torch.as_tensor(list(doc), dtype=torch.int64)
    if t.dim() != 1:
        raise ValueError(f"each document must be a 1-D token sequence, got shape {tuple(t.shape)}")
    return t.detach().to("cpu", torch.int64)


# ---------------------------------------------------------------------------------------------- samples
def fixed_shape_sample(
    bin_size: int,
    capacity: int,
    *,
    max_seqlen: int | None = None,
    vocab_size: int = 258,
    pad_to_multiple: int = 1,
    device: torch.device | str | None = None,
    seed: int = 0,
) -> PackedBatch:
    """A deterministic random batch with the static signature of any ``from_documents`` batch built with the same
    ``(bin_size, capacity, max_seqlen, pad_to_multiple)``: the sample a capture uses.

    It holds ``capacity`` documents with random lengths that fill the bin as far as ``max_seqlen`` allows (every
    document has >= 1 token when ``bin_size // pad_to_multiple >= capacity``) and random tokens in
    ``[0, vocab_size)``. Tail rows get ``PAD_ID`` when it is in the vocabulary, else 0.
    """
    if bin_size < 1 or capacity < 1 or pad_to_multiple < 1 or vocab_size < 1:
        raise ValueError("bin_size, capacity, pad_to_multiple and vocab_size must be >= 1")
    if max_seqlen is not None and max_seqlen < 1:
        raise ValueError(f"max_seqlen must be >= 1, got {max_seqlen}")
    m = pad_to_multiple
    longest = bin_size if max_seqlen is None else min(max_seqlen, bin_size)
    units = _sample_units(bin_size // m, capacity, -(-longest // m), random.Random(seed))
    rng = random.Random(seed + 1)
    lengths = []
    for u in units:
        if u == 0:
            lengths.append(0)
            continue
        # Vary each length within its footprint (so padding rows appear) without changing the footprint.
        top = min(u * m, longest)
        lengths.append(max((u - 1) * m + 1, top - rng.randrange(m)))
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randint(0, vocab_size, (sum(lengths),), generator=gen, dtype=torch.int64)
    docs = list(torch.split(flat, lengths))
    pad_id = PAD_ID if PAD_ID < vocab_size else 0
    batch = PackedBatch.from_documents(
        docs, bin_size=bin_size, capacity=capacity, max_seqlen=max_seqlen, pad_to_multiple=m, pad_id=pad_id
    )
    return batch if device is None else batch.to(device)


def _sample_units(units: int, capacity: int, max_units: int, rng: random.Random) -> list[int]:
    """Split ``min(units, capacity * max_units)`` units over ``capacity`` docs, each <= max_units, >= 1 if possible."""
    budget = min(units, capacity * max_units)
    alloc = [1 if i < budget else 0 for i in range(capacity)]
    left = budget - sum(alloc)
    if left:
        weights = [rng.expovariate(1.0) for _ in range(capacity)]  # heavy-ish tail, like real documents
        total = sum(weights)
        for i, w in enumerate(weights):
            give = min(int(left * w / total), max_units - alloc[i])
            alloc[i] += give
        left = budget - sum(alloc)
        for i in rng.sample(range(capacity), capacity):
            give = min(left, max_units - alloc[i])
            alloc[i] += give
            left -= give
    return alloc


# ---------------------------------------------------------------------------------------------- corpus -> batches
class CorpusBatches(Iterator[PackedBatch]):
    """The batches of a packed corpus, in bin order; each is built when iterated to.

    Attributes:
        packing: the :class:`Packing` the batches follow.
        policy: the :class:`BucketPolicy` that chose each batch's static (max_seqlen, capacity).
    """

    def __init__(self, docs: Sequence[Tensor], packing: Packing, policy: BucketPolicy, pad_to_multiple: int) -> None:
        self.docs = docs
        self.packing = packing
        self.policy = policy
        self.pad_to_multiple = pad_to_multiple
        self._next_bin = 0

    def __len__(self) -> int:
        return len(self.packing) - self._next_bin

    def __next__(self) -> PackedBatch:
        if self._next_bin >= len(self.packing):
            raise StopIteration
        indices = self.packing[self._next_bin]
        self._next_bin += 1
        lengths = [self.packing.lengths[i] for i in indices]
        bucket = self.policy.bucket_for(max(lengths, default=0), len(indices))
        return PackedBatch.from_documents(
            [self.docs[i][:n] for i, n in zip(indices, lengths, strict=True)],
            bin_size=self.packing.bin_size,
            capacity=bucket.capacity,
            max_seqlen=bucket.max_seqlen,
            pad_to_multiple=self.pad_to_multiple,
        )


def batches_from_corpus(
    docs: Sequence[Tensor | Sequence[int]],
    *,
    bin_size: int,
    policy: BucketPolicy,
    algorithm: str = "ffd",
    max_seqs_per_bin: int | None = None,
    pad_to_multiple: int = 1,
    overlong: str = "truncate",
) -> CorpusBatches:
    """Pack ``docs`` and yield one fixed-shape :class:`PackedBatch` per bin, in bin order (deterministic).

    Each batch has ``T = bin_size`` rows and its bucket's static ``(max_seqlen, capacity)`` from ``policy``. A
    document is limited to ``min(bin_size, policy.max_seqlen)`` tokens: longer ones are truncated
    (``overlong="truncate"``, listed in ``.packing.truncated``) or rejected (``"raise"``). Packing and argument
    checks happen here, before the first batch is built.

    Args:
        max_seqs_per_bin: documents per bin; defaults to (and may not exceed) the policy's largest capacity.

    Raises:
        ValueError: ``max_seqs_per_bin`` above the largest capacity, or an overlong document with ``"raise"``.
    """
    if max_seqs_per_bin is None:
        max_seqs_per_bin = policy.max_capacity
    if max_seqs_per_bin > policy.max_capacity:
        raise ValueError(
            f"max_seqs_per_bin={max_seqs_per_bin} exceeds the policy's largest capacity {policy.max_capacity}"
        )
    lengths = [len(d) for d in docs]
    if policy.max_seqlen < bin_size:
        # The policy caps document length below a bin: apply that cap here so packing sees the same lengths.
        over = [i for i, n in enumerate(lengths) if n > policy.max_seqlen]
        if over and overlong == "raise":
            raise ValueError(
                f"{len(over)} documents exceed the policy's largest max_seqlen {policy.max_seqlen} "
                f"(first: {over[:20]}); pass overlong='truncate' or extend the ladder"
            )
        capped = [min(n, policy.max_seqlen) for n in lengths]
    else:
        over, capped = [], lengths
    packing = pack_sequences(
        capped,
        bin_size,
        max_seqs_per_bin=max_seqs_per_bin,
        multiple=pad_to_multiple,
        algorithm=algorithm,
        overlong=overlong,
    )
    if over:
        packing.truncated = tuple(sorted(set(packing.truncated) | set(over)))
    return CorpusBatches(docs, packing, policy, pad_to_multiple)
