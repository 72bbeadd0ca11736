"""Bin packing of documents into fixed-size token streams: which documents share a batch.

:func:`pack_sequences` assigns documents to bins of ``bin_size`` rows (first-, best- or next-fit decreasing) and
returns a :class:`Packing`; :meth:`PackedBatch.from_documents <packgraph.packing.PackedBatch.from_documents>` then
lays one bin out as a fixed-shape batch.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from torch import Tensor

from packgraph.params import whole_lengths

__all__ = ["PACKING_ALGORITHMS", "Packing", "pack_sequences"]

PACKING_ALGORITHMS: tuple[str, ...] = ("ffd", "bfd", "nfd")
"""The ``algorithm`` values :func:`pack_sequences` takes: first-, best- and next-fit decreasing."""


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
        lengths: host-side document lengths: whole numbers >= 0 (ints, or floats with no fraction), or a 1-D
            tensor of them.
        overlong: a document whose footprint exceeds ``bin_size``: ``"raise"`` a ``ValueError`` naming the
            indices, or ``"truncate"`` it to the longest length whose footprint fits (listed in
            ``Packing.truncated``). Documents are never dropped.

    Raises:
        ValueError: bad arguments, or an overlong document with ``overlong="raise"``.
    """
    lengths = whole_lengths(lengths, lambda rule, detail: ValueError(f"pack_sequences: lengths {rule} ({detail})"))
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
