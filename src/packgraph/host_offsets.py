"""Host copies of packed-sequence offsets, bound to the tensors they were read from.

:class:`~packgraph.params.PackedSeqParams` keeps them in ``host_offsets`` so that validation and bucketing read
offsets with no device sync. A copy is trusted only while its field still holds the very tensor it was read from,
unwritten since: :meth:`HostOffsets.describes` is that test.

"Unwritten" is told by the tensor's version counter, which only writes through the tensor itself bump. A write that
bypasses it (through ``.numpy()``, ``.data``, DLPack or ``__cuda_array_interface__``) leaves the version as it was.
On the CPU the values are compared as well, at the cost of one ``torch.equal`` of ``capacity + 1`` ints, so such a
write is caught there: the copies stop describing the field, and ``validate`` raises, since the same write on a GPU
would go unseen (:meth:`HostOffsets.written_behind_version`). On a GPU it is invisible without a device-to-host read
(a sync), and the copies stay trusted: after writing offsets that way, rebuild the params (``from_seqlens``, or
``replace`` with the new tensors, which drops the copies), or drop the copies with ``replace(host_offsets=None)`` so
the params count as device-only and ``validate(sync=True)`` (the engine's ``validate="sync"``) reads the device.
Writing in place through the tensor (``cu_seqlens_q.copy_(...)``) bumps the version and needs none of this.
"""

from __future__ import annotations

import array
import weakref
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["HostOffsets"]


class HostOffsets(dict):
    """Host copies of offset tensors (field name -> tuple of ints), bound to the tensors they were read from.

    Each field remembers which tensor object it describes (weakly) and that tensor's autograd ``_version`` then.
    The copies describe a field only while it still holds that very tensor at that version:
    :meth:`PackedSeqParams.current_host_offsets` stops trusting them after a reassignment (even of a tensor of the
    same length) or an in-place write (``cu_seqlens_q.copy_(...)`` bumps the version), and never trusts them for an
    inference tensor, which has no version to tell an in-place write by. For a CPU tensor they also compare the
    values, which catches a write that keeps the version (``.numpy()``, ``.data``); for a GPU tensor that would
    take a sync, so such a write goes unseen there (the module docstring says what to do instead).
    """

    def __init__(self, offsets: Mapping[str, Sequence[int]], tensors: Mapping[str, Tensor]) -> None:
        super().__init__({name: tuple(offs) for name, offs in offsets.items()})
        self.sources = {name: (weakref.ref(t), _version_of(t)) for name, t in tensors.items()}
        # Per field: (the host tuple, the same values as a CPU tensor), built on the first CPU check and reused, so
        # later checks are one torch.equal rather than a .tolist() of the tensor.
        self._cpu_values: dict[str, tuple[tuple[int, ...], Tensor]] = {}

    def describes(self, name: str, t: Tensor) -> bool:
        """Whether the copy of field ``name`` is still the value of ``t``: same tensor object, same version and,
        for a CPU tensor, the same values."""
        return self._unwritten(name, t) and (t.device.type != "cpu" or self._holds_values(name, t))

    def written_behind_version(self, name: str, t: Tensor) -> bool:
        """Whether ``t``, a CPU tensor, is the very tensor the copy of ``name`` was read from, at the same version,
        yet holds other values: written through ``.numpy()`` or ``.data`` (or bound to copies that never described
        it). The same write to a GPU tensor is invisible without a sync."""
        return t.device.type == "cpu" and self._unwritten(name, t) and not self._holds_values(name, t)

    def _unwritten(self, name: str, t: Tensor) -> bool:
        source = self.sources.get(name)
        if source is None:
            return False
        ref, version = source
        return ref() is t and version is not None and _version_of(t) == version

    def _holds_values(self, name: str, t: Tensor) -> bool:
        offs = self[name]
        if t.dim() != 1 or t.numel() != len(offs) or t.dtype.is_floating_point or t.dtype.is_complex:
            return False
        cached = self._cpu_values.get(name)
        if cached is None or cached[0] is not offs or cached[1].dtype != t.dtype:
            # Fields that share one tuple (q and kv of self-attention) share its tensor.
            cached = next((c for c in self._cpu_values.values() if c[0] is offs and c[1].dtype == t.dtype), None)
            if cached is None:
                try:
                    cached = (offs, _cpu_tensor(offs, t.dtype))
                except (OverflowError, RuntimeError):  # a value the tensor's dtype cannot hold: not its value
                    return False
            self._cpu_values[name] = cached
        return torch.equal(t, cached[1])


_ARRAY_CODES = {torch.int32: "i", torch.int64: "q"}


def _cpu_tensor(values: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    code = _ARRAY_CODES.get(dtype)
    if code is None or array.array(code).itemsize != dtype.itemsize:
        return torch.tensor(values, dtype=dtype)
    # Through a C array: about 3x faster than torch.tensor on a tuple of Python ints.
    return torch.frombuffer(array.array(code, values), dtype=dtype) if values else torch.empty(0, dtype=dtype)


def _version_of(t: Tensor) -> int | None:
    """``t``'s autograd version counter, or None for an inference tensor (which has none)."""
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version
        return None
