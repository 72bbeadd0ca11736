"""From how many slots (``cu_seqlens`` entries minus one, ghosts included) causal self-attention runs
:mod:`packgraph.ops.short_docs` instead of one FlashAttention call: one value that ``packgraph.ops`` reads to choose
the kernel and ``packgraph.buckets`` reads so that a bucket never changes the choice.

Contract: the two kernels round short documents differently, so the result of a batch must not depend on which
bucket it is padded to. With ``SHORT_DOCS_MIN_SLOTS = m`` set:

* a capacity ladder that has rungs of ``m`` slots or more must have one of ``m - 1`` (else a batch of fewer than
  ``m`` documents could land in a bucket of ``m`` or more): :func:`check_capacity_ladder`. ``BucketPolicy``
  adds that rung to the ladders it is given (:func:`with_boundary_rung`);
* a batch whose params have ``m`` slots or more keeps at least ``m`` in its bucket, whatever its ghost slots:
  :func:`bucket_slots`;
* a captured graph records the value, and a call under another one takes another graph
  (``packgraph.graphs``' call signature).

It is :data:`DEFAULT` (129) unless the environment variable ``PACKGRAPH_SHORT_DOCS_MIN_SLOTS`` sets another
number at import, or ``off`` (``None``: FlashAttention everywhere, and nothing above applies); ``packgraph bench``
records the value with the machine. Assign it before building bucket policies and capturing: a policy checks its
ladder when it buckets, and a graph captured under another value is never replayed.
"""

from __future__ import annotations

import os

__all__ = ["SHORT_DOCS_MIN_SLOTS", "short_docs_for", "with_boundary_rung", "check_capacity_ladder", "bucket_slots"]

ENV = "PACKGRAPH_SHORT_DOCS_MIN_SLOTS"


DEFAULT = 129
"""One more than the default ladders' rung of 128 slots (``default_buckets``), so that their buckets of 512 slots
and more run short_docs and the others FlashAttention. The H200 timings behind it are in docs/buckets.md."""


def _from_environment() -> int | None:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT
    if raw.lower() in ("off", "none"):
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{ENV} must be a number of slots (an int >= 1) or 'off', got {raw!r}")
    return value


SHORT_DOCS_MIN_SLOTS: int | None = _from_environment()
"""From how many slots short_docs runs (None: never). :data:`DEFAULT` unless the environment says otherwise."""


def short_docs_for(slots: int) -> bool:
    """Whether ``slots`` slots select short_docs (for causal self-attention; ``packgraph.ops`` checks the rest)."""
    return SHORT_DOCS_MIN_SLOTS is not None and slots >= SHORT_DOCS_MIN_SLOTS


def with_boundary_rung(ladder: tuple[int, ...]) -> tuple[int, ...]:
    """``ladder`` (sorted, unique), with a rung of ``SHORT_DOCS_MIN_SLOTS - 1`` added when it has rungs of that
    many slots or more and lacks it: the ladder :func:`check_capacity_ladder` accepts. Unchanged when off."""
    m = SHORT_DOCS_MIN_SLOTS
    if m is None or m <= 1 or ladder[-1] < m or m - 1 in ladder:
        return ladder
    return tuple(sorted((*ladder, m - 1)))


def check_capacity_ladder(ladder: tuple[int, ...]) -> None:
    """Raise ValueError if a bucket of ``ladder`` would take batches on both sides of ``SHORT_DOCS_MIN_SLOTS``:
    if :func:`with_boundary_rung` would add a rung to it."""
    if with_boundary_rung(ladder) == ladder:
        return
    m = SHORT_DOCS_MIN_SLOTS
    raise ValueError(
        f"capacity ladder {ladder} has rungs of {m} slots or more but none of {m - 1}: with "
        f"packgraph.slot_boundary.SHORT_DOCS_MIN_SLOTS = {m}, a batch of fewer than {m} documents would run "
        f"FlashAttention eagerly and short_docs in its bucket, which round differently. Build the BucketPolicy after "
        f"setting SHORT_DOCS_MIN_SLOTS (it then adds that rung), or give it a rung of {m - 1} slots."
    )


def bucket_slots(capacity: int, num_seqs: int) -> int:
    """The slots a bucket must hold for params of ``capacity`` slots of which ``num_seqs`` are used: at least
    ``SHORT_DOCS_MIN_SLOTS`` when ``capacity`` has that many, so that dropping ghost slots keeps the kernel."""
    if short_docs_for(capacity):
        return max(num_seqs, SHORT_DOCS_MIN_SLOTS)  # type: ignore[arg-type]
    return num_seqs
