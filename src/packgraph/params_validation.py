"""The rules of the PackedSeqParams contract, and the error that names a broken one.

:meth:`PackedSeqParams.validate <packgraph.params.PackedSeqParams.validate>` runs :func:`validate` (structure always,
values from the host when they can be read without a sync); :meth:`PackedSeqParams.assert_valid_async
<packgraph.params.PackedSeqParams.assert_valid_async>` runs the same value rules on the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from packgraph.static_signature import DYNAMIC_FIELDS

if TYPE_CHECKING:
    from packgraph.params import PackedSeqParams

__all__ = ["KNOWN_QKV_FORMATS", "PackedSeqParamsError", "assert_valid_async", "validate"]

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


def validate(params: PackedSeqParams, *, sync: bool, capacity: int | None) -> None:
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


def assert_valid_async(params: PackedSeqParams) -> None:
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
