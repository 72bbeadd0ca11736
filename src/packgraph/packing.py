"""Fixed-shape packed batches, and the pipeline from a corpus to them.

Two steps turn a corpus into graph-ready batches:

1. :func:`pack_sequences` (:mod:`packgraph.bin_packing`, importable from here) assigns documents to bins of
   ``bin_size`` rows (first-, best- or next-fit decreasing).
2. :meth:`PackedBatch.from_documents` lays one bin out as a THD stream of exactly ``bin_size`` rows with
   ``capacity`` ``cu_seqlens`` slots, so every batch of one bucket has the same shapes and static signature.

:func:`batches_from_corpus` chains both with a :class:`~packgraph.buckets.BucketPolicy`;
:func:`fixed_shape_sample` builds the sample batch a capture uses.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
from torch import Tensor

# Re-exported: the packing API is imported from packgraph.packing.
from packgraph.bin_packing import PACKING_ALGORITHMS, Packing, pack_sequences
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
        tokens, labels, position_ids = _lay_out(tensors, params.host_offsets, bin_size, pad_id)
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


def _lay_out(
    docs: list[Tensor], host: Mapping[str, Sequence[int]], bin_size: int, pad_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``tokens``, ``labels`` and ``position_ids`` of ``docs`` laid out at their host offsets' layout starts."""
    lengths = [int(t.numel()) for t in docs]
    starts = host.get("cu_seqlens_q_padded", host["cu_seqlens_q"])[: len(lengths)]
    tokens = torch.full((bin_size,), pad_id, dtype=torch.int64)
    labels = torch.full((bin_size,), IGNORE_INDEX, dtype=torch.int64)
    position_ids = torch.zeros(bin_size, dtype=torch.int64)
    n_real = sum(lengths)
    if n_real:
        flat = torch.cat(docs)
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
    return tokens, labels, position_ids


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
