"""From how many slots (``cu_seqlens`` entries minus one, ghosts included) causal self-attention runs
:mod:`packgraph.ops.short_docs` instead of one FlashAttention call, and the rules that keep buckets from changing
that choice.

The switch is data: ``PackedSeqParams.short_docs_min_slots`` (``None``: FlashAttention everywhere), which
``packgraph.ops`` reads to choose the kernel and which the params' static signature carries, so a graph captured
under one value is never replayed under another. A :class:`~packgraph.buckets.BucketPolicy` has the same field and
stamps it on the params it buckets. The two kernels round short documents differently, so the result of a batch
must not depend on which bucket it is padded to. With the switch at ``m``:

* a capacity ladder that has rungs of ``m`` slots or more must have one of ``m - 1`` (else a batch of fewer than
  ``m`` documents could land in a bucket of ``m`` or more): ``BucketPolicy`` adds that rung to the ladders it is
  given (:func:`with_boundary_rung`);
* a batch whose params have ``m`` slots or more keeps at least ``m`` in its bucket, whatever its ghost slots:
  :func:`bucket_slots`.

Both fields default to :data:`DEFAULT_MIN_SLOTS`: :data:`DEFAULT` (129), unless the environment variable
``PACKGRAPH_SHORT_DOCS_MIN_SLOTS`` sets another number at import, or ``off``. ``packgraph bench`` records it with
the machine.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "DEFAULT_MIN_SLOTS",
    "check_min_slots",
    "is_min_slots",
    "short_docs_for",
    "with_boundary_rung",
    "bucket_slots",
]

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


DEFAULT_MIN_SLOTS: int | None = _from_environment()
"""The default of the switch (``PackedSeqParams.short_docs_min_slots``, ``BucketPolicy.short_docs_min_slots``):
:data:`DEFAULT` unless the environment said otherwise at import. Read once; change the fields, not this."""


def is_min_slots(m: Any) -> bool:
    """Whether ``m`` can be the switch: None (never) or an int >= 1."""
    return m is None or (isinstance(m, int) and not isinstance(m, bool) and m >= 1)


def check_min_slots(m: Any, where: str) -> None:
    """Raise ValueError unless :func:`is_min_slots` (``where`` names the field in the message)."""
    if not is_min_slots(m):
        raise ValueError(f"{where} must be a number of slots (an int >= 1) or None (never), got {m!r}")


def short_docs_for(slots: int, m: int | None) -> bool:
    """Whether ``slots`` slots select short_docs under the switch ``m`` (for causal self-attention;
    ``packgraph.ops`` checks the rest)."""
    return m is not None and slots >= m


def with_boundary_rung(ladder: tuple[int, ...], m: int | None) -> tuple[int, ...]:
    """``ladder`` (sorted, unique), with a rung of ``m - 1`` added when it has rungs of ``m`` slots or more and
    lacks it, so that no bucket takes batches on both sides of the switch. Unchanged when ``m`` is None."""
    if m is None or m <= 1 or ladder[-1] < m or m - 1 in ladder:
        return ladder
    return tuple(sorted((*ladder, m - 1)))


def bucket_slots(capacity: int, num_seqs: int, m: int | None) -> int:
    """The slots a bucket must hold for params of ``capacity`` slots of which ``num_seqs`` are used: at least ``m``
    when ``capacity`` has that many, so that dropping ghost slots keeps the kernel."""
    if m is not None and short_docs_for(capacity, m):
        return max(num_seqs, m)
    return num_seqs
