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

Also here, in this order: the signature's parts (:class:`StaticSignature`, :class:`TensorSpec`,
:class:`GroupIdentity`); the registry of foreign params classes the engine splits like these
(:func:`register_params_type`: Megatron's, whose integration module registers it and is imported at the first
sight of one, so a Megatron params object never reaches a graph as an opaque argument); the rules of the contract
(:class:`PackedSeqParamsError` names the field and the broken rule); and :class:`HostOffsets`.

**Host offsets.** ``host_offsets`` keeps host copies of the offsets so that validation and bucketing read them with
no device sync. A copy is trusted only while its field holds the very tensor it was read from, unwritten since
(:meth:`HostOffsets.describes`). "Unwritten" is told by the tensor's version counter, which only writes through the
tensor bump: a write through ``.numpy()``, ``.data``, DLPack or ``__cuda_array_interface__`` leaves it as it was.
On the CPU the values are compared too (one ``torch.equal`` of ``capacity + 1`` ints), so such a write is caught and
``validate`` raises, since the same write on a GPU would go unseen without a sync. After writing GPU offsets that
way, rebuild the params (``from_seqlens``, or ``replace`` with the new tensors, which drops the copies), or drop the
copies with ``replace(host_offsets=None)`` so that ``validate(sync=True)`` reads the device. An in-place write
through the tensor (``cu_seqlens_q.copy_(...)``) bumps the version and needs none of this.
"""

from __future__ import annotations

import array
import dataclasses
import importlib
import math
import numbers
import operator
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from packgraph import slot_boundary

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
    "tensor_version",
    "TensorSpec",
]

MAMBA_FIELDS: tuple[str, ...] = ("total_tokens", "seq_idx")
"""Fields only Mamba layers read. They never cross an attention graph boundary (see ``attention_view``)."""

INT32_MAX = 2**31 - 1
"""The largest offset an int32 ``cu_seqlens`` holds."""


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
    short_docs_min_slots: int | None = slot_boundary.DEFAULT_MIN_SLOTS

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


class ParamsType(NamedTuple):
    """How the engine carries another library's packed-sequence params class (Megatron's) across a graph boundary.

    ``to_packgraph(obj)`` returns a :class:`PackedSeqParams` sharing ``obj``'s tensors (no copies, no syncs);
    ``from_packgraph(params)`` builds an instance of the foreign class from packgraph params, again sharing tensors.
    """

    to_packgraph: Callable[[Any], PackedSeqParams]
    from_packgraph: Callable[[PackedSeqParams], Any]


_PARAMS_TYPES: dict[type, ParamsType] = {}
# Qualified class name -> the integration module that registers it on import.
_KNOWN_FOREIGN = {"megatron.core.packed_seq_params.PackedSeqParams": "packgraph.integrations.megatron"}
# Classes already looked up and found unregistered, so a lookup on every call costs one set probe.
_NOT_PARAMS: set[type] = set()


def register_params_type(
    cls: type, *, to_packgraph: Callable[[Any], PackedSeqParams], from_packgraph: Callable[[PackedSeqParams], Any]
) -> None:
    """Let ``capture``/``capture_layers`` split instances of ``cls`` like :class:`PackedSeqParams` (see
    :class:`ParamsType`). The captured callable then receives an instance of ``cls`` rebuilt on static buffers."""
    _PARAMS_TYPES[cls] = ParamsType(to_packgraph, from_packgraph)
    _NOT_PARAMS.discard(cls)


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


def _validate(params: PackedSeqParams, *, sync: bool, capacity: int | None) -> None:
    """Check ``params`` as :meth:`PackedSeqParams.validate <packgraph.params.PackedSeqParams.validate>` states."""
    if params.qkv_format not in KNOWN_QKV_FORMATS:
        raise PackedSeqParamsError(
            "qkv_format", "unknown format", f"{params.qkv_format!r}; packed layouts supported: {KNOWN_QKV_FORMATS}"
        )
    _check_offset_tensors(params, capacity)
    _check_static_ints(params)
    if params.seq_idx is not None:
        want = (1, params.total_tokens)
        if params.seq_idx.dtype != torch.int32 or tuple(params.seq_idx.shape) != want:
            raise PackedSeqParamsError(
                "seq_idx", f"must be int32 {list(want)}", f"got {params.seq_idx.dtype} {list(params.seq_idx.shape)}"
            )
    values = _host_values(params, sync)
    if values is not None:
        _check_values(params, values)


def _check_offset_tensors(params: PackedSeqParams, capacity: int | None) -> None:
    for name in ("cu_seqlens_q", "cu_seqlens_kv"):
        if getattr(params, name) is None:
            raise PackedSeqParamsError(name, "required for qkv_format='thd'")
    ref_device = params.cu_seqlens_q.device if isinstance(params.cu_seqlens_q, Tensor) else None
    for name in DYNAMIC_FIELDS:
        t = getattr(params, name)
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
    if params.seq_idx is not None and params.seq_idx.device != ref_device:
        raise PackedSeqParamsError("seq_idx", "all tensors must be on one device", f"{params.seq_idx.device}")
    n_q = params.cu_seqlens_q.numel()
    for name, t in params.graph_inputs().items():
        if name != "seq_idx" and t.numel() != n_q:
            raise PackedSeqParamsError(
                name, "q/kv capacity mismatch", f"{t.numel() - 1} slots vs cu_seqlens_q's {n_q - 1}"
            )
    if capacity is not None and n_q - 1 != capacity:
        raise PackedSeqParamsError("cu_seqlens_q", "capacity not respected", f"{n_q - 1} slots, expected {capacity}")


def _check_static_ints(params: PackedSeqParams) -> None:
    m = params.short_docs_min_slots
    if not slot_boundary.is_min_slots(m):
        raise PackedSeqParamsError("short_docs_min_slots", "must be a slot count (an int >= 1) or None", f"got {m!r}")
    for name in ("max_seqlen_q", "max_seqlen_kv", "total_tokens", "local_cp_size"):
        v = getattr(params, name)
        if v is None:
            if name.startswith("max_seqlen"):
                raise PackedSeqParamsError(name, "required (a static Python int)")
            continue
        if not isinstance(v, int) or isinstance(v, bool):
            raise PackedSeqParamsError(name, "must be a Python int (static)", f"got {type(v).__name__}")
        if v < (0 if name == "total_tokens" else 1):
            raise PackedSeqParamsError(name, "must be positive", f"got {v}")


def _host_values(params: PackedSeqParams, sync: bool) -> dict[str, list[int]] | None:
    """The offset values, read without a sync when possible; None when only a device read would give them."""
    present = {k: v for k, v in params.graph_inputs().items() if k != "seq_idx"}
    host = params.current_host_offsets()
    if host is not None and set(host) >= set(present):
        return {k: list(host[k]) for k in present}
    if params.device.type == "cpu":
        return {k: v.tolist() for k, v in present.items()}
    if not sync:
        return None
    names = list(present)
    flat = torch.cat([present[k] for k in names]).cpu().tolist()  # the one device-to-host read
    n = params.cu_seqlens_q.numel()
    return {k: flat[i * n : (i + 1) * n] for i, k in enumerate(names)}


def _check_values(params: PackedSeqParams, values: Mapping[str, list[int]]) -> None:
    for name, offs in values.items():
        if offs[0] != 0:
            raise PackedSeqParamsError(name, "must start at 0", f"first offset {offs[0]}")
        for i in range(1, len(offs)):
            if offs[i] < offs[i - 1]:
                raise PackedSeqParamsError(
                    name, "offsets must be non-decreasing", f"slot {i - 1}: {offs[i - 1]} -> {offs[i]}"
                )
        if params.total_tokens is not None and offs[-1] > params.total_tokens:
            raise PackedSeqParamsError(name, "last offset exceeds total_tokens", f"{offs[-1]} > {params.total_tokens}")
    for name, max_name in _MAX_SEQLEN_OF.items():
        offs = values[name]
        longest = max((b - a for a, b in zip(offs, offs[1:], strict=False)), default=0)
        limit = getattr(params, max_name)
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


def _assert_valid_async(params: PackedSeqParams) -> None:
    """The value rules of :func:`validate` as ``torch._assert_async`` device asserts (see
    :meth:`PackedSeqParams.assert_valid_async <packgraph.params.PackedSeqParams.assert_valid_async>`)."""
    for name, t in params.graph_inputs().items():
        if name == "seq_idx":
            continue
        torch._assert_async(t[0] == 0, f"PackedSeqParams.{name}: must start at 0")
        diffs = t[1:] - t[:-1]
        torch._assert_async((diffs >= 0).all(), f"PackedSeqParams.{name}: offsets must be non-decreasing")
        if params.total_tokens is not None:
            torch._assert_async(t[-1] <= params.total_tokens, f"PackedSeqParams.{name}: exceeds total_tokens")
    for name, max_name in _MAX_SEQLEN_OF.items():
        t = getattr(params, name)
        torch._assert_async(
            ((t[1:] - t[:-1]) <= getattr(params, max_name)).all(),
            f"PackedSeqParams.{max_name}: below a real sequence length",
        )
    for padded_name, real_name in _PADDED_TWIN.items():
        p, r = getattr(params, padded_name), getattr(params, real_name)
        if p is not None:
            torch._assert_async(
                ((p[1:] - p[:-1]) >= (r[1:] - r[:-1])).all(),
                f"PackedSeqParams.{padded_name}: padded length below unpadded length",
            )


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
        self.sources = {name: (weakref.ref(t), tensor_version(t)) for name, t in tensors.items()}
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
        return ref() is t and version is not None and tensor_version(t) == version

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


def tensor_version(t: Tensor) -> int | None:
    """``t``'s autograd version counter, or None for an inference tensor (which has none)."""
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
            Copies made stale by a write are not trusted (:meth:`current_host_offsets`); on a GPU that needs the
            write to bump the tensor's version (see there).
        short_docs_min_slots: from how many slots causal self-attention runs :mod:`packgraph.ops.short_docs`
            instead of one FlashAttention call (``None``: never; :mod:`packgraph.slot_boundary`). Static, in the
            signature. Not a Megatron field: a ``BucketPolicy`` stamps its own on the params it buckets.
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
    short_docs_min_slots: int | None = slot_boundary.DEFAULT_MIN_SLOTS

    def __post_init__(self) -> None:
        if self.host_offsets is not None and not isinstance(self.host_offsets, HostOffsets):
            tensors = {name: t for name in self.host_offsets if isinstance(t := getattr(self, name, None), Tensor)}
            self.host_offsets = HostOffsets(self.host_offsets, tensors)

    def current_host_offsets(self) -> Mapping[str, tuple[int, ...]] | None:
        """``host_offsets`` if they still describe every tensor field they cover, else None (the params then count
        as device-only). A field assigned directly (not through :meth:`replace`), an in-place write, or an inference
        tensor makes them stale (:class:`HostOffsets`).

        On the CPU the copies are also compared with the tensors' values (one ``torch.equal`` per field), so a write
        that keeps the version counter (through ``.numpy()`` or ``.data``) makes them stale as well. On a GPU that
        comparison would be a sync: a write through ``.data``, DLPack or ``__cuda_array_interface__`` goes unseen and
        the old copies stay trusted. After such a write rebuild the params (``from_seqlens``, or :meth:`replace` with
        the tensors), or call ``replace(host_offsets=None)`` and validate with ``sync=True``.
        """
        host = self.host_offsets
        if host is None:
            return None
        checked = set()
        for name, offs in host.items():
            t = getattr(self, name, None)
            if not isinstance(t, Tensor) or (id(t), id(offs)) in checked:  # q and kv often share both
                continue
            if len(offs) != t.numel() or not host.describes(name, t):
                return None
            checked.add((id(t), id(offs)))
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
            lengths: real length of each document, in stream order: whole numbers (ints, or floats with no
                fraction), or a 1-D CPU tensor of them.
            capacity: number of slots (static). Defaults to ``len(lengths)``; slots past the documents are
                ghosts that repeat the last offset.
            total_tokens: stream size ``T`` (static). Defaults to the last (padded) offset.
            pad_to_multiple: when > 1, each document is padded in memory to a multiple of this and
                ``cu_seqlens_*_padded`` are filled (context-parallel divisibility).
            max_seqlen: static max seqlen for both q and kv. Defaults to the true max (at least 1).
            device: where the tensors live.

        Raises:
            PackedSeqParamsError: lengths that are not whole numbers (a fraction, a 2-D tensor) or are negative,
                offsets past int32, more documents than ``capacity``, a ``total_tokens`` or ``max_seqlen`` too
                small for the documents.
        """
        if isinstance(lengths, Tensor) and lengths.device.type != "cpu":
            raise PackedSeqParamsError("lengths", "must be host-side", "pass a list or a CPU tensor")
        lengths = whole_lengths(lengths, lambda rule, detail: PackedSeqParamsError("lengths", rule, detail))
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
        padded = None
        if pad_to_multiple > 1:
            padded = _offsets([-(-n // pad_to_multiple) * pad_to_multiple for n in lengths], ghost_slots)
            host.update(cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)
        last = (offsets if padded is None else padded)[-1]
        if last > INT32_MAX:
            raise PackedSeqParamsError(
                "lengths",
                "offsets overflow int32",
                f"the documents take {last} rows > {INT32_MAX}; cu_seqlens are int32: split them over batches",
            )
        if total_tokens is None:
            total_tokens = last
        if max_seqlen is None:
            max_seqlen = max(max(lengths, default=0), 1)
        cu = torch.tensor(offsets, dtype=torch.int32, device=device)
        cu_padded = None if padded is None else torch.tensor(padded, dtype=torch.int32, device=device)
        # q and kv share one tensor for self-attention: one buffer, one copy at replay.
        params = cls(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu_padded,
            cu_seqlens_kv_padded=cu_padded,
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
        """The device of the tensor fields (``cu_seqlens_q``'s)."""
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
            short_docs_min_slots=self.short_docs_min_slots,
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
            short_docs_min_slots=signature.short_docs_min_slots,
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
        length, padded >= unpadded per sequence) are checked from ``host_offsets`` when they are current
        (:meth:`current_host_offsets`; no sync), from the tensors directly when they are on the CPU, and with
        **one** device-to-host read when ``sync=True``. Device-only params with ``sync=False`` get the structural
        checks only. Current host offsets are read even with ``sync=True``: on a GPU, drop them
        (``replace(host_offsets=None)``) after writing the offsets behind the version counter. On the CPU such a
        write (through ``.numpy()`` or ``.data``) is an error: host offsets that disagree with their unchanged
        tensor are what the same write on a GPU would leave unseen.

        Args:
            sync: allow one device-to-host copy to check device-only values.
            capacity: if given, the slot count the params must have (e.g. a graph's).

        Raises:
            PackedSeqParamsError: naming the field and the broken rule.
        """
        _validate(self, sync=sync, capacity=capacity)
        if self.host_offsets is not None and self.current_host_offsets() is None:
            self._check_not_written_behind_version()
        return self

    def _check_not_written_behind_version(self) -> None:
        host = self.host_offsets
        if not isinstance(host, HostOffsets):
            return
        for name, offs in host.items():
            t = getattr(self, name, None)
            if isinstance(t, Tensor) and host.written_behind_version(name, t):
                values = t.tolist()
                slot = next((i for i, (a, b) in enumerate(zip(offs, values, strict=False)) if a != b), len(offs))
                shown = (
                    f"offset {slot}: host {offs[slot]}, tensor {values[slot]}"
                    if slot < min(len(offs), len(values))
                    else f"{len(offs)} host offsets, {len(values)} in the tensor"
                )
                raise PackedSeqParamsError(
                    name,
                    "host_offsets disagree with the tensor",
                    f"{shown}; it was written without bumping its version (.numpy(), .data), which a GPU would not "
                    "see: write through the tensor (copy_), rebuild the params, or replace(host_offsets=None)",
                )

    def assert_valid_async(self) -> None:
        """Debug-mode value checks on the device with ``torch._assert_async``: graph-safe and sync-free.

        A failing check does not raise here: it triggers a device-side assert that **poisons the CUDA
        context** (every later CUDA call fails; the process must restart). Use it to debug, not to recover.
        """
        _assert_valid_async(self)


def slot_of_rows(offsets: Tensor, rows: Tensor) -> Tensor:
    """For each row, the slot ``s`` with ``offsets[s] <= row < offsets[s + 1]``: int64, shaped like ``rows``.

    Zero-length (ghost) slots are skipped (the last slot starting at or before the row wins); rows at or past
    the last offset get ``len(offsets) - 1``. One ``searchsorted`` on the device: fixed shape, no host sync.
    """
    # The whole tensor, not offsets[1:]: inductor cannot lower searchsorted over a slice view (SliceView).
    return (torch.searchsorted(offsets, rows, right=True) - 1).clamp_(min=0)


def whole_lengths(lengths: Iterable[Any] | Tensor, error: Callable[[str, str], Exception]) -> list[int]:
    """``lengths`` as Python ints: each a whole number (an int, a NumPy int, a float with no fraction, a one-element
    tensor of one), or ``lengths`` a 1-D tensor of them. Raises ``error(rule, detail)`` otherwise, naming the first
    offender, rather than truncating a fraction (``int(2.7)`` is 2) or failing inside ``int()``."""
    if isinstance(lengths, Tensor):
        if lengths.dim() != 1:
            raise error("must be 1-D", f"got a tensor of shape {tuple(lengths.shape)}; pass one length per document")
        if lengths.dtype == torch.bool or lengths.dtype.is_complex:
            raise error("must be whole numbers", f"got a {lengths.dtype} tensor; pass an integer tensor")
        lengths = lengths.tolist()
    elif isinstance(lengths, str | bytes) or not isinstance(lengths, Iterable):
        raise error("must be a sequence of whole numbers", f"got {type(lengths).__name__}; pass a list or a tensor")
    lengths = list(lengths)
    if all(type(n) is int for n in lengths):  # the common case, and an integer tensor's .tolist()
        return lengths
    out = []
    for i, n in enumerate(lengths):
        value = _whole_number(n)
        if value is None:
            raise error(
                "must be whole numbers",
                f"lengths[{i}] is {n!r}; pass one integer token count per document, rounded or cast to int",
            )
        out.append(value)
    return out


def _whole_number(n: Any) -> int | None:
    if isinstance(n, Tensor):
        if n.numel() != 1 or n.dtype == torch.bool:
            return None
        n = n.item()
    if isinstance(n, bool):  # an int to Python, but no length
        return None
    try:
        return operator.index(n)
    except TypeError:
        pass
    if isinstance(n, numbers.Real):
        f = float(n)
        if math.isfinite(f) and f.is_integer():
            return int(f)
    return None


def _offsets(lengths: Sequence[int], ghost_slots: int) -> tuple[int, ...]:
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    return tuple(offs + [offs[-1]] * ghost_slots)
