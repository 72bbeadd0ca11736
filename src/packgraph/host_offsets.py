"""Host copies of packed-sequence offsets, bound to the tensors they were read from.

:class:`~packgraph.params.PackedSeqParams` keeps them in ``host_offsets`` so that validation and bucketing read
offsets with no device sync. A copy is trusted only while its field still holds the very tensor it was read from,
unwritten since: :meth:`HostOffsets.describes` is that test.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence

from torch import Tensor

__all__ = ["HostOffsets"]


class HostOffsets(dict):
    """Host copies of offset tensors (field name -> tuple of ints), bound to the tensors they were read from.

    Each field remembers which tensor object it describes (weakly) and that tensor's autograd ``_version`` then.
    The copies describe a field only while it still holds that very tensor at that version:
    :meth:`PackedSeqParams.current_host_offsets` stops trusting them after a reassignment (even of a tensor of the
    same length) or an in-place write (``cu_seqlens_q.copy_(...)`` bumps the version), and never trusts them for an
    inference tensor, which has no version to tell an in-place write by.
    """

    def __init__(self, offsets: Mapping[str, Sequence[int]], tensors: Mapping[str, Tensor]) -> None:
        super().__init__({name: tuple(offs) for name, offs in offsets.items()})
        self.sources = {name: (weakref.ref(t), _version_of(t)) for name, t in tensors.items()}

    def describes(self, name: str, t: Tensor) -> bool:
        """Whether the copy of field ``name`` is still the value of ``t``."""
        source = self.sources.get(name)
        if source is None:
            return False
        ref, version = source
        return ref() is t and version is not None and _version_of(t) == version


def _version_of(t: Tensor) -> int | None:
    """``t``'s autograd version counter, or None for an inference tensor (which has none)."""
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version
        return None
