"""PackedSeqParams and the CUDA-graph contract for packed (THD) sequences.

A packed batch concatenates documents into one token stream of fixed size ``T``. ``cu_seqlens`` (int32,
``[capacity + 1]``) holds the cumulative offsets; unused slots repeat the last offset ("ghost" slots, zero-length
sequences), so the tensor's *shape* stays fixed while the number of documents changes.

The contract, as the graph engine uses it:

* **Dynamic fields** (:data:`DYNAMIC_FIELDS`, plus ``seq_idx`` when present) are graph inputs: tensors whose
  values change per batch and are copied into static buffers at each replay.
* **Static metadata** (:meth:`PackedSeqParams.static_signature`) is everything else: ``qkv_format``, the max
  seqlens, ``local_cp_size``, the identity of ``cp_group``, ``total_tokens``, and per dynamic field whether it
  is present, its shape (hence the capacity), dtype and device. A graph is valid for exactly one signature.
* :meth:`PackedSeqParams.from_graph_inputs` rebuilds params from the two halves.

Field names follow Megatron-LM's ``megatron.core.packed_seq_params.PackedSeqParams``.
"""

from __future__ import annotations

import dataclasses
import importlib
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "DYNAMIC_FIELDS",
    "MAMBA_FIELDS",
    "KNOWN_QKV_FORMATS",
    "PackedSeqParams",
    "PackedSeqParamsError",
    "StaticSignature",
    "GroupIdentity",
    "HostOffsets",
    "ParamsType",
    "register_params_type",
    "params_type_of",
    "slot_of_rows",
]

DYNAMIC_FIELDS: tuple[str, ...] = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
"""The tensor fields that are graph inputs. Their values change per batch; their shapes are static."""

MAMBA_FIELDS: tuple[str, ...] = ("total_tokens", "seq_idx")
"""Fields only Mamba layers read. They never cross an attention graph boundary (see ``attention_view``)."""

KNOWN_QKV_FORMATS: tuple[str, ...] = ("thd",)
"""Packed layouts packgraph runs. Megatron's ``sbhd``/``bshd`` are padded layouts, not packed ones."""

_PADDED_TWIN = {"cu_seqlens_q_padded": "cu_seqlens_q", "cu_seqlens_kv_padded": "cu_seqlens_kv"}
_MAX_SEQLEN_OF = {"cu_seqlens_q": "max_seqlen_q", "cu_seqlens_kv": "max_seqlen_kv"}


class PackedSeqParamsError(ValueError):
    """A PackedSeqParams breaks the contract. ``field`` names the culprit and ``rule`` the broken rule."""

    def __init__(self, field: str, rule: str, detail: str = "") -> None:
        self.field = field
        self.rule = rule
        self.detail = detail
        msg = f"PackedSeqParams.{field}: {rule}"
        super().__init__(f"{msg} ({detail})" if detail else msg)


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
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version
        return None


@dataclass(eq=False)
class PackedSeqParams:
    """Packed-sequence metadata, Megatron-compatible.

    Fields:
        qkv_format: ``"thd"`` (tokens, heads, head_dim). Static.
        cu_seqlens_q / cu_seqlens_kv: int32 ``[capacity + 1]`` cumulative *real* lengths. Dynamic.
        cu_seqlens_q_padded / cu_seqlens_kv_padded: optional int32 ``[capacity + 1]`` offsets of each sequence
            in memory when sequences are padded (to a multiple, e.g. for context parallelism). When present,
            sequence ``i`` occupies rows ``[padded[i], padded[i] + len_i)`` and rows up to ``padded[i + 1]``
            are padding. Dynamic.
        max_seqlen_q / max_seqlen_kv: static upper bound on every real length. Attention kernels size their
            launch grid from it; a value below a real length gives silently wrong output, so ``validate``
            rejects it.
        local_cp_size / cp_group: context-parallel size and group. Static (group compared by identity).
        total_tokens: the size ``T`` of the token stream (Mamba). Static.
        seq_idx: optional int32 ``[1, total_tokens]`` document index of each row (Mamba). Dynamic.
        host_offsets: host copies of the dynamic fields' values, when known (``from_seqlens``, the packer).
            They let ``validate`` check values with no device sync. Not a Megatron field; not in the signature.
            Copies made stale by an in-place write are not trusted (:meth:`current_host_offsets`).
    """

    qkv_format: str = "thd"
    cu_seqlens_q: Tensor | None = None
    cu_seqlens_kv: Tensor | None = None
    cu_seqlens_q_padded: Tensor | None = None
    cu_seqlens_kv_padded: Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None
    local_cp_size: int | None = None
    cp_group: Any = None
    total_tokens: int | None = None
    seq_idx: Tensor | None = None
    host_offsets: Mapping[str, tuple[int, ...]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.host_offsets is not None and not isinstance(self.host_offsets, HostOffsets):
            tensors = {name: t for name in self.host_offsets if isinstance(t := getattr(self, name, None), Tensor)}
            self.host_offsets = HostOffsets(self.host_offsets, tensors)

    def current_host_offsets(self) -> Mapping[str, tuple[int, ...]] | None:
        """``host_offsets`` if they still describe every tensor field they cover, else None.

        They describe a field only while it holds the very tensor they were read from, at the autograd version it
        had then (see :class:`HostOffsets`): a field assigned directly (not through :meth:`replace`), an in-place
        write, or an inference tensor (no version) makes them stale, and the params then count as device-only.
        """
        host = self.host_offsets
        if host is None:
            return None
        for name, offs in host.items():
            t = getattr(self, name, None)
            if not isinstance(t, Tensor):
                continue
            if len(offs) != t.numel() or not host.describes(name, t):
                return None
        return host

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_seqlens(
        cls,
        lengths: Sequence[int] | Tensor,
        *,
        capacity: int | None = None,
        total_tokens: int | None = None,
        pad_to_multiple: int = 1,
        max_seqlen: int | None = None,
        device: torch.device | str | None = None,
    ) -> PackedSeqParams:
        """Build fixed-capacity params from host-side document lengths.

        Args:
            lengths: real length of each document, in stream order (ints, or a CPU tensor).
            capacity: number of slots (static). Defaults to ``len(lengths)``; slots past the documents are
                ghosts that repeat the last offset.
            total_tokens: stream size ``T`` (static). Defaults to the last (padded) offset.
            pad_to_multiple: when > 1, each document is padded in memory to a multiple of this and
                ``cu_seqlens_*_padded`` are filled (context-parallel divisibility).
            max_seqlen: static max seqlen for both q and kv. Defaults to the true max (at least 1).
            device: where the tensors live.

        Raises:
            PackedSeqParamsError: negative lengths, more documents than ``capacity``, a ``total_tokens`` or
                ``max_seqlen`` too small for the documents.
        """
        if isinstance(lengths, Tensor):
            if lengths.device.type != "cpu":
                raise PackedSeqParamsError("lengths", "must be host-side", "pass a list or a CPU tensor")
            lengths = lengths.tolist()
        lengths = [int(n) for n in lengths]
        if any(n < 0 for n in lengths):
            raise PackedSeqParamsError("cu_seqlens_q", "lengths must be >= 0", f"got {lengths}")
        if pad_to_multiple < 1:
            raise PackedSeqParamsError("cu_seqlens_q_padded", "pad_to_multiple must be >= 1")
        capacity = len(lengths) if capacity is None else int(capacity)
        if len(lengths) > capacity:
            raise PackedSeqParamsError(
                "cu_seqlens_q", "more sequences than capacity", f"{len(lengths)} sequences, capacity {capacity}"
            )
        ghost_slots = capacity - len(lengths)
        offsets = _offsets(lengths, ghost_slots)
        host = {"cu_seqlens_q": offsets, "cu_seqlens_kv": offsets}
        if pad_to_multiple > 1:
            padded = _offsets([-(-n // pad_to_multiple) * pad_to_multiple for n in lengths], ghost_slots)
            host.update(cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)
        end = host.get("cu_seqlens_q_padded", offsets)[-1]
        if total_tokens is None:
            total_tokens = end
        true_max = max(lengths, default=0)
        if max_seqlen is None:
            max_seqlen = max(true_max, 1)
        tensors = {}
        for name in ("cu_seqlens_q", "cu_seqlens_q_padded"):
            if name in host:
                tensors[name] = torch.tensor(host[name], dtype=torch.int32, device=device)
        # q and kv share one tensor for self-attention: one buffer, one copy at replay.
        params = cls(
            qkv_format="thd",
            cu_seqlens_q=tensors["cu_seqlens_q"],
            cu_seqlens_kv=tensors["cu_seqlens_q"],
            cu_seqlens_q_padded=tensors.get("cu_seqlens_q_padded"),
            cu_seqlens_kv_padded=tensors.get("cu_seqlens_q_padded"),
            max_seqlen_q=int(max_seqlen),
            max_seqlen_kv=int(max_seqlen),
            total_tokens=int(total_tokens),
            host_offsets=host,
        )
        params.validate()
        return params

    @classmethod
    def from_hf_kwargs(cls, kwargs: Mapping[str, Any], *, total_tokens: int | None = None) -> PackedSeqParams:
        """Build params from Hugging Face flash-attention kwargs.

        Reads ``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_length_q`` and ``max_length_k``. The max lengths must
        be Python ints (static); a tensor there would need a host sync, so it is rejected.
        """
        for key in ("max_length_q", "max_length_k"):
            if isinstance(kwargs.get(key), Tensor):
                raise PackedSeqParamsError(
                    key, "must be a Python int (static)", "a tensor would need .item(); use a bucket's value"
                )
        cu_q = kwargs.get("cu_seq_lens_q")
        cu_k = kwargs.get("cu_seq_lens_k", cu_q)
        return cls(
            qkv_format="thd",
            cu_seqlens_q=cu_q,
            cu_seqlens_kv=cu_k,
            max_seqlen_q=kwargs.get("max_length_q"),
            max_seqlen_kv=kwargs.get("max_length_k", kwargs.get("max_length_q")),
            total_tokens=total_tokens,
        )

    def to_hf_kwargs(self) -> dict[str, Any]:
        """The Hugging Face flash-attention kwargs for these params (padded layout is not representable)."""
        if self.cu_seqlens_q_padded is not None or self.cu_seqlens_kv_padded is not None:
            raise PackedSeqParamsError(
                "cu_seqlens_q_padded", "not representable in HF kwargs", "HF has no padded-layout offsets"
            )
        return {
            "cu_seq_lens_q": self.cu_seqlens_q,
            "cu_seq_lens_k": self.cu_seqlens_kv,
            "max_length_q": self.max_seqlen_q,
            "max_length_k": self.max_seqlen_kv,
        }

    # ------------------------------------------------------------------ views
    @property
    def capacity(self) -> int:
        """Number of slots (static): ``cu_seqlens_q.numel() - 1``."""
        return self.cu_seqlens_q.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens_q.device

    def layout_offsets(self, which: str = "q") -> Tensor:
        """Offsets of each sequence in memory: the padded twin if present, else the real offsets."""
        padded = getattr(self, f"cu_seqlens_{which}_padded")
        return padded if padded is not None else getattr(self, f"cu_seqlens_{which}")

    def replace(self, **changes: Any) -> PackedSeqParams:
        """A copy with some fields changed (``dataclasses.replace``). Host offsets are dropped when any
        dynamic field changes, since they would no longer describe the tensors."""
        if any(k in changes for k in DYNAMIC_FIELDS):
            if "host_offsets" not in changes:
                changes["host_offsets"] = None
            elif isinstance(changes["host_offsets"], HostOffsets):
                # The caller vouches that they describe the new tensors: bind them to those.
                changes["host_offsets"] = dict(changes["host_offsets"])
        return dataclasses.replace(self, **changes)

    def attention_view(self) -> PackedSeqParams:
        """These params without the Mamba-only fields: what may cross an attention graph boundary."""
        if self.total_tokens is None and self.seq_idx is None:
            return self
        return dataclasses.replace(self, total_tokens=None, seq_idx=None)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedSeqParams:
        """Move the tensor fields to ``device``; fields that share a tensor keep sharing one. Current host offsets
        stay trusted (the moved tensors hold the same values)."""
        moved: dict[int, Tensor] = {}
        changes = {}
        for name in (*DYNAMIC_FIELDS, "seq_idx"):
            t = getattr(self, name)
            if t is not None:
                if id(t) not in moved:
                    moved[id(t)] = t.to(device, non_blocking=non_blocking)
                changes[name] = moved[id(t)]
        host = self.current_host_offsets()
        return dataclasses.replace(self, host_offsets=None if host is None else dict(host), **changes)

    def with_seq_idx(self) -> PackedSeqParams:
        """Params with Mamba's ``seq_idx`` derived on the device, shaped ``[1, total_tokens]`` int32.

        Row ``r`` gets the index of the slot whose (layout) range holds it; rows past the last offset get
        ``capacity``. Deterministic (searchsorted), no host sync, fixed shape.
        """
        if self.total_tokens is None:
            raise PackedSeqParamsError("total_tokens", "required to derive seq_idx")
        offsets = self.layout_offsets("q")
        rows = torch.arange(self.total_tokens, device=offsets.device, dtype=offsets.dtype)
        seq_idx = slot_of_rows(offsets, rows).to(torch.int32)
        return dataclasses.replace(self, seq_idx=seq_idx.view(1, -1))

    # ------------------------------------------------------------------ graph contract
    def graph_inputs(self) -> dict[str, Tensor]:
        """The dynamic tensors, by field name (present fields only). Values change per batch."""
        return {name: getattr(self, name) for name in (*DYNAMIC_FIELDS, "seq_idx") if getattr(self, name) is not None}

    def static_signature(self) -> StaticSignature:
        """A frozen, hashable description of everything static (see module docstring)."""
        return StaticSignature(
            qkv_format=self.qkv_format,
            max_seqlen_q=self.max_seqlen_q,
            max_seqlen_kv=self.max_seqlen_kv,
            local_cp_size=self.local_cp_size,
            cp_group=GroupIdentity(self.cp_group),
            total_tokens=self.total_tokens,
            tensors=tuple((name, TensorSpec.of(getattr(self, name))) for name in (*DYNAMIC_FIELDS, "seq_idx")),
        )

    @classmethod
    def from_graph_inputs(cls, inputs: Mapping[str, Tensor], signature: StaticSignature) -> PackedSeqParams:
        """Rebuild params from ``graph_inputs()`` and ``static_signature()``.

        Raises:
            PackedSeqParamsError: a present field is missing from ``inputs``, or an input does not match the
                signature's shape/dtype.
        """
        tensors = {}
        for name, spec in signature.tensors:
            if not spec.present:
                continue
            if name not in inputs:
                raise PackedSeqParamsError(name, "missing from graph inputs", "the signature says it is present")
            t = inputs[name]
            if TensorSpec.of(t) != spec:
                raise PackedSeqParamsError(name, "does not match the signature", f"{TensorSpec.of(t)} vs {spec}")
            tensors[name] = t
        return cls(
            qkv_format=signature.qkv_format,
            max_seqlen_q=signature.max_seqlen_q,
            max_seqlen_kv=signature.max_seqlen_kv,
            local_cp_size=signature.local_cp_size,
            cp_group=signature.cp_group.obj,
            total_tokens=signature.total_tokens,
            **tensors,
        )

    def equals(self, other: PackedSeqParams) -> bool:
        """Same static signature and equal tensor values (host offsets are not compared)."""
        if self.static_signature() != other.static_signature():
            return False
        mine, theirs = self.graph_inputs(), other.graph_inputs()
        return mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)

    # ------------------------------------------------------------------ validation
    def validate(self, *, sync: bool = False, capacity: int | None = None) -> PackedSeqParams:
        """Check the contract; return ``self``.

        Structure (dtype int32, 1-D, one device, q/kv capacity, ``qkv_format``, static ints) is always
        checked. Values (start at 0, non-decreasing, within ``total_tokens``, ``max_seqlen`` >= every real
        length, padded >= unpadded per sequence) are checked from ``host_offsets`` when known (no sync), from
        the tensors directly when they are on the CPU, and with **one** device-to-host read when ``sync=True``.
        Device-only params with ``sync=False`` get the structural checks only.

        Args:
            sync: allow one device-to-host copy to check device-only values.
            capacity: if given, the slot count the params must have (e.g. a graph's).

        Raises:
            PackedSeqParamsError: naming the field and the broken rule.
        """
        if self.qkv_format not in KNOWN_QKV_FORMATS:
            raise PackedSeqParamsError(
                "qkv_format", "unknown format", f"{self.qkv_format!r}; packed layouts supported: {KNOWN_QKV_FORMATS}"
            )
        for name in ("cu_seqlens_q", "cu_seqlens_kv"):
            if getattr(self, name) is None:
                raise PackedSeqParamsError(name, "required for qkv_format='thd'")
        ref_device = self.cu_seqlens_q.device if isinstance(self.cu_seqlens_q, Tensor) else None
        present = self.graph_inputs()
        for name in DYNAMIC_FIELDS:
            t = getattr(self, name)
            if t is None:
                continue
            if not isinstance(t, Tensor):
                raise PackedSeqParamsError(name, "must be a torch.Tensor", f"got {type(t).__name__}")
            if t.dtype != torch.int32:
                raise PackedSeqParamsError(name, "dtype must be torch.int32", f"got {t.dtype}")
            if t.dim() != 1:
                raise PackedSeqParamsError(name, "must be 1-D", f"got shape {tuple(t.shape)}")
            if t.numel() < 1:
                raise PackedSeqParamsError(name, "must have at least one offset")
            if t.device != ref_device:
                raise PackedSeqParamsError(name, "all tensors must be on one device", f"{t.device} vs {ref_device}")
        if self.seq_idx is not None and self.seq_idx.device != ref_device:
            raise PackedSeqParamsError("seq_idx", "all tensors must be on one device", f"{self.seq_idx.device}")
        n_q = self.cu_seqlens_q.numel()
        for name, t in present.items():
            if name != "seq_idx" and t.numel() != n_q:
                raise PackedSeqParamsError(
                    name, "q/kv capacity mismatch", f"{t.numel() - 1} slots vs cu_seqlens_q's {n_q - 1}"
                )
        if capacity is not None and n_q - 1 != capacity:
            raise PackedSeqParamsError(
                "cu_seqlens_q", "capacity not respected", f"{n_q - 1} slots, expected {capacity}"
            )
        for name in ("max_seqlen_q", "max_seqlen_kv", "total_tokens", "local_cp_size"):
            v = getattr(self, name)
            if v is None:
                if name.startswith("max_seqlen"):
                    raise PackedSeqParamsError(name, "required (a static Python int)")
                continue
            if isinstance(v, Tensor) or not isinstance(v, int) or isinstance(v, bool):
                raise PackedSeqParamsError(name, "must be a Python int (static)", f"got {type(v).__name__}")
            if v < (0 if name == "total_tokens" else 1):
                raise PackedSeqParamsError(name, "must be positive", f"got {v}")
        if self.seq_idx is not None:
            want = (1, self.total_tokens)
            if self.seq_idx.dtype != torch.int32 or tuple(self.seq_idx.shape) != want:
                raise PackedSeqParamsError(
                    "seq_idx", f"must be int32 {list(want)}", f"got {self.seq_idx.dtype} {list(self.seq_idx.shape)}"
                )
        values = self._host_values(sync)
        if values is not None:
            self._validate_values(values)
        return self

    def _host_values(self, sync: bool) -> dict[str, list[int]] | None:
        present = {k: v for k, v in self.graph_inputs().items() if k != "seq_idx"}
        host = self.current_host_offsets()
        if host is not None and set(host) >= set(present):
            return {k: list(host[k]) for k in present}
        if self.device.type == "cpu":
            return {k: v.tolist() for k, v in present.items()}
        if not sync:
            return None
        names = list(present)
        flat = torch.cat([present[k] for k in names]).cpu().tolist()  # the one device-to-host read
        n = self.cu_seqlens_q.numel()
        return {k: flat[i * n : (i + 1) * n] for i, k in enumerate(names)}

    def _validate_values(self, values: Mapping[str, list[int]]) -> None:
        for name, offs in values.items():
            if offs[0] != 0:
                raise PackedSeqParamsError(name, "must start at 0", f"first offset {offs[0]}")
            for i in range(1, len(offs)):
                if offs[i] < offs[i - 1]:
                    raise PackedSeqParamsError(
                        name, "offsets must be non-decreasing", f"slot {i - 1}: {offs[i - 1]} -> {offs[i]}"
                    )
            if self.total_tokens is not None and offs[-1] > self.total_tokens:
                raise PackedSeqParamsError(
                    name, "last offset exceeds total_tokens", f"{offs[-1]} > {self.total_tokens}"
                )
        for name, max_name in _MAX_SEQLEN_OF.items():
            offs = values[name]
            longest = max((b - a for a, b in zip(offs, offs[1:], strict=False)), default=0)
            limit = getattr(self, max_name)
            if longest > limit:
                raise PackedSeqParamsError(
                    max_name,
                    "below a real sequence length",
                    f"{limit} < {longest}; FlashAttention would silently compute wrong output",
                )
        for padded_name, real_name in _PADDED_TWIN.items():
            if padded_name not in values:
                continue
            p, r = values[padded_name], values[real_name]
            for i in range(len(r) - 1):
                if p[i + 1] - p[i] < r[i + 1] - r[i]:
                    raise PackedSeqParamsError(
                        padded_name,
                        "padded length below unpadded length",
                        f"slot {i}: {p[i + 1] - p[i]} < {r[i + 1] - r[i]}",
                    )

    def assert_valid_async(self) -> None:
        """Debug-mode value checks on the device with ``torch._assert_async``: graph-safe and sync-free.

        A failing check does not raise here: it triggers a device-side assert that **poisons the CUDA
        context** (every later CUDA call fails; the process must restart). Use it to debug, not to recover.
        """
        for name, t in self.graph_inputs().items():
            if name == "seq_idx":
                continue
            torch._assert_async(t[0] == 0, f"PackedSeqParams.{name}: must start at 0")
            diffs = t[1:] - t[:-1]
            torch._assert_async((diffs >= 0).all(), f"PackedSeqParams.{name}: offsets must be non-decreasing")
            if self.total_tokens is not None:
                torch._assert_async(t[-1] <= self.total_tokens, f"PackedSeqParams.{name}: exceeds total_tokens")
        for name, max_name in _MAX_SEQLEN_OF.items():
            t = getattr(self, name)
            torch._assert_async(
                ((t[1:] - t[:-1]) <= getattr(self, max_name)).all(),
                f"PackedSeqParams.{max_name}: below a real sequence length",
            )
        for padded_name, real_name in _PADDED_TWIN.items():
            p, r = getattr(self, padded_name), getattr(self, real_name)
            if p is not None:
                torch._assert_async(
                    ((p[1:] - p[:-1]) >= (r[1:] - r[:-1])).all(),
                    f"PackedSeqParams.{padded_name}: padded length below unpadded length",
                )


class ParamsType(NamedTuple):
    """How the engine carries another library's packed-sequence params class (Megatron's) across a graph boundary.

    ``to_packgraph(obj)`` returns a :class:`PackedSeqParams` sharing ``obj``'s tensors (no copies, no syncs);
    ``from_packgraph(params)`` builds an instance of the foreign class from packgraph params, again sharing tensors.
    """

    to_packgraph: Callable[[Any], PackedSeqParams]
    from_packgraph: Callable[[PackedSeqParams], Any]


_PARAMS_TYPES: dict[type, ParamsType] = {}
# Foreign classes the engine recognises before their integration module is imported: the module registers them.
_KNOWN_FOREIGN = {"megatron.core.packed_seq_params.PackedSeqParams": "packgraph.integrations.megatron"}


def register_params_type(
    cls: type, *, to_packgraph: Callable[[Any], PackedSeqParams], from_packgraph: Callable[[PackedSeqParams], Any]
) -> None:
    """Let ``capture``/``capture_layers`` split instances of ``cls`` like :class:`PackedSeqParams` (see
    :class:`ParamsType`). The captured callable then receives an instance of ``cls`` rebuilt on static buffers."""
    _PARAMS_TYPES[cls] = ParamsType(to_packgraph, from_packgraph)
    _NOT_PARAMS.discard(cls)


_NOT_PARAMS: set[type] = set()


def params_type_of(obj: Any) -> ParamsType | None:
    """The registered :class:`ParamsType` of ``obj``'s class (importing its integration on first sight), or None."""
    cls = type(obj)
    found = _PARAMS_TYPES.get(cls)
    if found is None and cls not in _NOT_PARAMS:
        module = _KNOWN_FOREIGN.get(f"{cls.__module__}.{cls.__qualname__}")
        if module is not None:
            importlib.import_module(module)
            found = _PARAMS_TYPES.get(cls)
        if found is None:
            _NOT_PARAMS.add(cls)
    return found


def slot_of_rows(offsets: Tensor, rows: Tensor) -> Tensor:
    """For each row, the slot ``s`` with ``offsets[s] <= row < offsets[s + 1]``: int64, shaped like ``rows``.

    Zero-length (ghost) slots are skipped (the last slot starting at or before the row wins); rows at or past
    the last offset get ``len(offsets) - 1``. One ``searchsorted`` on the device: fixed shape, no host sync.
    It searches the whole ``offsets`` tensor rather than ``offsets[1:]``: inductor (torch 2.11) cannot lower
    ``searchsorted`` over a slice view ("NotImplementedError: SliceView").
    """
    return (torch.searchsorted(offsets, rows, right=True) - 1).clamp_(min=0)


def _offsets(lengths: Sequence[int], ghost_slots: int) -> tuple[int, ...]:
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    return tuple(offs + [offs[-1]] * ghost_slots)
