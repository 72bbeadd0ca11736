"""From how many slots (``cu_seqlens`` entries minus one, ghosts included) causal self-attention runs
:mod:`packgraph.ops.short_docs` instead of one FlashAttention call: one value that ``packgraph.ops`` reads to choose
the kernel and ``packgraph.buckets`` reads so that a bucket never changes the choice.

Contract: the two kernels round short documents differently, so the result of a batch must not depend on which
bucket it is padded to. With ``SHORT_DOCS_MIN_SLOTS = m`` set:

* a capacity ladder that has rungs of ``m`` slots or more must have one of ``m - 1`` (else a batch of fewer than
  ``m`` documents could land in a bucket of ``m`` or more): :func:`check_capacity_ladder`;
* a batch whose params have ``m`` slots or more keeps at least ``m`` in its bucket, whatever its ghost slots:
  :func:`bucket_slots`;
* a captured graph records the value, and a call under another one takes another graph
  (``packgraph.graphs``' call signature).

``None`` (the default) turns it off: FlashAttention everywhere, and nothing above applies. The environment
variable ``PACKGRAPH_SHORT_DOCS_MIN_SLOTS`` sets it at import (``packgraph bench`` records the value with the
machine), or assign it before capturing; a graph captured under another value is never replayed.
"""

from __future__ import annotations

import os

__all__ = ["SHORT_DOCS_MIN_SLOTS", "short_docs_for", "check_capacity_ladder", "bucket_slots"]

ENV = "PACKGRAPH_SHORT_DOCS_MIN_SLOTS"


def _from_environment() -> int | None:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be a number of slots (an int >= 1), got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{ENV} must be a number of slots (an int >= 1), got {value}")
    return value


SHORT_DOCS_MIN_SLOTS: int | None = _from_environment()
"""Off unless set: the H200 runs of docs/buckets.md (last section) found it pays on the bucket tour's largest
buckets only, at a fixed cost per call, and its bucket-invariant setting (513, past a rung of 512) is not measured."""


def short_docs_for(slots: int) -> bool:
    """Whether ``slots`` slots select short_docs (for causal self-attention; ``packgraph.ops`` checks the rest)."""
    return SHORT_DOCS_MIN_SLOTS is not None and slots >= SHORT_DOCS_MIN_SLOTS


def check_capacity_ladder(ladder: tuple[int, ...]) -> None:
    """Raise ValueError if a bucket of ``ladder`` would take batches on both sides of ``SHORT_DOCS_MIN_SLOTS``."""
    m = SHORT_DOCS_MIN_SLOTS
    if m is None or m <= 1 or ladder[-1] < m or m - 1 in ladder:
        return
    raise ValueError(
        f"capacity ladder {ladder} has rungs of {m} slots or more but none of {m - 1}: with "
        f"packgraph.slot_boundary.SHORT_DOCS_MIN_SLOTS = {m}, a batch of fewer than {m} documents would run "
        f"FlashAttention eagerly and short_docs in its bucket, which round differently. Add a rung of {m - 1} "
        "slots, or set SHORT_DOCS_MIN_SLOTS to one more than a rung."
    )


def bucket_slots(capacity: int, num_seqs: int) -> int:
    """The slots a bucket must hold for params of ``capacity`` slots of which ``num_seqs`` are used: at least
    ``SHORT_DOCS_MIN_SLOTS`` when ``capacity`` has that many, so that dropping ghost slots keeps the kernel."""
    if short_docs_for(capacity):
        return max(num_seqs, SHORT_DOCS_MIN_SLOTS)  # type: ignore[arg-type]
    return num_seqs
