"""The graph-facing split of a :class:`~packgraph.params.PackedSeqParams` (the contract is in
:mod:`packgraph.params`): the :data:`DYNAMIC_FIELDS` are graph inputs, and a :class:`StaticSignature` is what a
captured graph bakes in. A signature is hashable, so it keys a graph cache; :meth:`StaticSignature.diff` names the
fields that differ when a call does not match a graph.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["DYNAMIC_FIELDS", "GroupIdentity", "StaticSignature", "TensorSpec"]

DYNAMIC_FIELDS: tuple[str, ...] = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
"""The tensor fields that are graph inputs. Their values change per batch; their shapes are static."""


@dataclass(frozen=True)
class GroupIdentity:
    """Hashes and compares a process group (or any object) by identity, so it can sit in a signature."""

    obj: Any

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GroupIdentity) and other.obj is self.obj

    def __repr__(self) -> str:
        if self.obj is None:
            return "None"
        name = getattr(self.obj, "group_name", None) or type(self.obj).__name__
        return f"<group {name} @ {id(self.obj):#x}>"


@dataclass(frozen=True)
class TensorSpec:
    """Presence, shape, dtype and device of one optional tensor field."""

    present: bool
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    device: str | None = None

    @classmethod
    def of(cls, t: Tensor | None) -> TensorSpec:
        """The spec of ``t``; ``absent`` for None."""
        if t is None:
            return cls(False)
        return cls(True, tuple(t.shape), t.dtype, str(t.device))

    def __repr__(self) -> str:
        if not self.present:
            return "absent"
        return f"{self.dtype}{list(self.shape)}@{self.device}"


@dataclass(frozen=True)
class StaticSignature:
    """Everything about a PackedSeqParams that a captured graph bakes in. Hashable; compare with ``==``.

    ``tensors`` maps each dynamic field (and ``seq_idx``) to its :class:`TensorSpec`; a field's shape fixes
    its capacity.
    """

    qkv_format: str
    max_seqlen_q: int | None
    max_seqlen_kv: int | None
    local_cp_size: int | None
    cp_group: GroupIdentity
    total_tokens: int | None
    tensors: tuple[tuple[str, TensorSpec], ...]

    @property
    def capacity(self) -> int | None:
        """The slot count ``cu_seqlens_q``'s shape fixes, or None when it is absent."""
        spec = dict(self.tensors).get("cu_seqlens_q")
        return spec.shape[0] - 1 if spec is not None and spec.present else None

    def diff(self, other: StaticSignature) -> list[tuple[str, Any, Any]]:
        """``[(field, self_value, other_value), ...]`` for every field that differs."""
        out = []
        for f in dataclasses.fields(self):
            if f.name == "tensors":
                mine, theirs = dict(self.tensors), dict(other.tensors)
                for name in sorted(set(mine) | set(theirs)):
                    a, b = mine.get(name, TensorSpec(False)), theirs.get(name, TensorSpec(False))
                    if a != b:
                        out.append((name, a, b))
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                out.append((f.name, a, b))
        return out
