"""Convert ``PackedSeqParams`` between packgraph and Megatron-Core, and build Megatron RL's fixed-size bin params.

packgraph's :class:`~packgraph.params.PackedSeqParams` uses Megatron's field names, so conversion is by name and
carries tensors by reference (no copies, no syncs):

* :func:`from_megatron` reads every dataclass field of a ``megatron.core.packed_seq_params.PackedSeqParams``
  (any Megatron-Core version). A field packgraph has no slot for raises, unless it holds its default (``None``)
  or a value packgraph derives itself (``pad_between_seqs``, which newer Megatron sets exactly when padded
  offsets are present).
* :func:`to_megatron` fills every field the installed Megatron class has. packgraph fields that class lacks
  (``total_tokens`` and ``seq_idx`` on Megatron-Core 0.16) raise when set; ``attention_view()`` drops them.
* ``host_offsets`` (packgraph's host copies of the offsets) have no Megatron field. :func:`to_megatron` keeps them
  beside the Megatron object, with the tensors they describe, and :func:`from_megatron` gives them back while the
  object still holds those very tensors. So params built on the host (the packer, ``from_seqlens``) keep their
  sync-free validation and exact bucketing through a Megatron model's forward; a tensor reassigned on the object
  drops them, and one written in place makes them stale (``PackedSeqParams.current_host_offsets``).

:func:`megatron_rl_bin_params` reproduces Megatron RL's ``create_packed_seq_params_for_bin``
(``megatron/rl/sequence_packing_utils.py`` in NVIDIA/Megatron-LM, the fixed-size version whose ``cu_seqlens`` has
``max_sequences_per_bin + 2`` entries), so Megatron RL users get the same shapes and values, hence the same graph
signatures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from packgraph import slot_boundary
from packgraph.params import PackedSeqParams, PackedSeqParamsError, whole_lengths

__all__ = ["from_megatron", "megatron_packed_seq_params_class", "megatron_rl_bin_params", "to_megatron"]

# Not Megatron fields: carried across a conversion as attributes of Megatron's object (below).
_NOT_MEGATRON = ("host_offsets", "short_docs_min_slots")
_PACKGRAPH_FIELDS = tuple(f.name for f in dataclasses.fields(PackedSeqParams) if f.name not in _NOT_MEGATRON)
_INT_FIELDS = ("max_seqlen_q", "max_seqlen_kv", "local_cp_size", "total_tokens")
_MAMBA_FIELDS = ("total_tokens", "seq_idx")
# Attribute (not a dataclass field) that to_megatron sets on a Megatron object: (host_offsets, {field: tensor}).
_HOST_OFFSETS_ATTR = "_packgraph_host_offsets"
# The short_docs switch of the params a Megatron object was made from (absent: the default), so that a round trip
# through Megatron's class keeps the kernel choice its signature records.
_SHORT_DOCS_ATTR = "_packgraph_short_docs_min_slots"


def megatron_packed_seq_params_class() -> type:
    """``megatron.core.packed_seq_params.PackedSeqParams``; ImportError with the install line if missing."""
    try:
        from megatron.core.packed_seq_params import PackedSeqParams as MegatronPackedSeqParams
    except ImportError as exc:
        raise ImportError(
            "packgraph.integrations.megatron needs Megatron-Core: pip install 'megatron-core>=0.16'"
        ) from exc
    return MegatronPackedSeqParams


def from_megatron(obj: Any, *, validate: bool = True) -> PackedSeqParams:
    """packgraph params with the same field values as a Megatron ``PackedSeqParams`` (tensors shared).

    Args:
        obj: a Megatron ``PackedSeqParams`` (or any dataclass with Megatron's field names).
        validate: run ``PackedSeqParams.validate()`` (structural checks; values too when on the CPU; no sync).

    Max seqlens given as tensors (older Megatron type hints) are accepted only on the CPU, where reading them
    costs no device sync; packgraph needs them as static ints.

    Raises:
        PackedSeqParamsError: a field packgraph cannot carry holds a value, a max seqlen is a device tensor, or
            validation fails.
    """
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"expected a Megatron PackedSeqParams instance, got {type(obj).__name__}")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name in _PACKGRAPH_FIELDS:
            values[f.name] = _static_int(f.name, value) if f.name in _INT_FIELDS else value
        elif f.name == "pad_between_seqs":
            padded = obj.cu_seqlens_q_padded is not None or obj.cu_seqlens_kv_padded is not None
            if bool(value) and not padded:
                raise PackedSeqParamsError(
                    "pad_between_seqs", "set without cu_seqlens_*_padded", "packgraph derives it from the padded twins"
                )
        elif value is not None and not _is_default(f, value):
            raise PackedSeqParamsError(
                f.name, "unknown to packgraph", f"value {value!r} would be lost in the conversion; clear it first"
            )
    params = PackedSeqParams(
        **values,
        host_offsets=_carried_host_offsets(obj),
        short_docs_min_slots=getattr(obj, _SHORT_DOCS_ATTR, slot_boundary.DEFAULT_MIN_SLOTS),
    )
    return params.validate() if validate else params


def to_megatron(params: PackedSeqParams) -> Any:
    """A Megatron ``PackedSeqParams`` with the same field values (tensors shared, nothing copied, no sync).

    ``total_tokens`` and ``seq_idx`` are set after construction: Megatron-Core >= 0.17 rebuilds ``seq_idx`` in
    ``__post_init__`` whenever ``total_tokens`` is given (a ``repeat_interleave``, a host sync on CUDA), which would
    replace the tensor these params carry. When ``total_tokens`` is set without ``seq_idx``, the Mamba layers still
    get one: ``params.with_seq_idx()``'s, built on the device (the same values as Megatron's).

    Raises:
        PackedSeqParamsError: a packgraph field the installed Megatron class lacks is set (for the Mamba-only
            ``total_tokens``/``seq_idx`` on Megatron-Core 0.16, pass ``params.attention_view()``).
        ImportError: Megatron-Core is not installed.
    """
    cls = megatron_packed_seq_params_class()
    theirs = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for name in _PACKGRAPH_FIELDS:
        value = getattr(params, name)
        if name in theirs:
            kwargs[name] = value
        elif value is not None:
            raise PackedSeqParamsError(
                name,
                "not a field of the installed Megatron PackedSeqParams",
                "pass params.attention_view() to drop the Mamba-only fields, or upgrade Megatron-Core",
            )
    if "pad_between_seqs" in theirs:
        kwargs["pad_between_seqs"] = params.cu_seqlens_q_padded is not None or params.cu_seqlens_kv_padded is not None
    after_init = {name: kwargs.pop(name) for name in _MAMBA_FIELDS if kwargs.get(name) is not None}
    if "total_tokens" in after_init and "seq_idx" not in after_init and "seq_idx" in theirs:
        after_init["seq_idx"] = params.with_seq_idx().seq_idx
    obj = cls(**kwargs)
    for name, value in after_init.items():
        object.__setattr__(obj, name, value)
    host = params.current_host_offsets()
    if host is not None:
        object.__setattr__(obj, _HOST_OFFSETS_ATTR, (host, {name: getattr(params, name) for name in host}))
    if params.short_docs_min_slots != slot_boundary.DEFAULT_MIN_SLOTS:
        object.__setattr__(obj, _SHORT_DOCS_ATTR, params.short_docs_min_slots)
    return obj


def megatron_rl_bin_params(
    seq_lengths: Sequence[int],
    *,
    bin_size: int,
    max_sequences_per_bin: int,
    seq_length_multiple: int = 1,
    device: torch.device | str | None = None,
) -> PackedSeqParams:
    """Megatron RL's fixed-size params for one packed bin (``create_packed_seq_params_for_bin``).

    Layout (all offsets int32, ``max_sequences_per_bin + 2`` entries, i.e. capacity ``max_sequences_per_bin + 1``):

    * the bin's sequences back to back, each placed at a multiple of ``seq_length_multiple`` (2 x the CP size for
      context parallelism);
    * then one trailing pseudo-sequence covering the rest of the bin (its pad tokens), so the layout tiles all
      ``bin_size`` rows;
    * then ghost slots: the last offset (``bin_size`` for the layout) repeated ("edge padding").

    ``cu_seqlens_q``/``_kv`` hold the real lengths (the trailing pseudo-sequence keeps its full size); the padded
    twins hold the aligned layout and are present only when alignment moved a sequence (as in Megatron, which
    leaves them ``None`` for back-to-back bins so Transformer Engine takes no padded path). ``max_seqlen_q/kv`` are
    ``bin_size`` and ``total_tokens`` is ``bin_size``. An empty bin gives one pseudo-sequence spanning the bin: the
    same values as Megatron's ``get_default_packed_seq_params`` (``[0, bin_size]``), edge-padded to this
    function's fixed ``max_sequences_per_bin + 2`` offsets.

    Example: lengths ``[7, 5]``, ``bin_size=16``, ``max_sequences_per_bin=4`` give ``[0, 7, 12, 16, 16, 16]``;
    with ``seq_length_multiple=4`` and ``bin_size=24``: padded ``[0, 8, 16, 24, 24, 24]``, real
    ``[0, 7, 12, 20, 20, 20]``.

    Raises:
        PackedSeqParamsError: more sequences than ``max_sequences_per_bin``, a negative length, a bin that does not
            hold the (aligned) sequences, or a ``bin_size`` not divisible by ``seq_length_multiple``.
    """
    lengths = whole_lengths(seq_lengths, lambda rule, detail: PackedSeqParamsError("seq_lengths", rule, detail))
    if max_sequences_per_bin < 1 or seq_length_multiple < 1 or bin_size < 1:
        raise PackedSeqParamsError(
            "cu_seqlens_q", "bin_size, max_sequences_per_bin and seq_length_multiple must be >= 1"
        )
    if len(lengths) > max_sequences_per_bin:
        raise PackedSeqParamsError(
            "cu_seqlens_q", "more sequences than max_sequences_per_bin", f"{len(lengths)} > {max_sequences_per_bin}"
        )
    if any(n < 0 for n in lengths):
        raise PackedSeqParamsError("cu_seqlens_q", "lengths must be >= 0", f"got {lengths}")
    if bin_size % seq_length_multiple:
        raise PackedSeqParamsError(
            "cu_seqlens_q_padded",
            "bin_size not divisible by seq_length_multiple",
            f"{bin_size} % {seq_length_multiple}",
        )
    footprints = [-(-n // seq_length_multiple) * seq_length_multiple for n in lengths]
    used = sum(footprints)
    if used > bin_size:
        raise PackedSeqParamsError("cu_seqlens_q", "sequences overflow the bin", f"{used} aligned tokens > {bin_size}")
    tail = bin_size - used
    entries = max_sequences_per_bin + 2
    real = _edge_padded([*lengths, tail], entries)
    layout = _edge_padded([*footprints, tail], entries)
    host = {"cu_seqlens_q": real, "cu_seqlens_kv": real}
    cu = torch.tensor(real, dtype=torch.int32, device=device)
    padded = None
    if layout != real:
        host.update(cu_seqlens_q_padded=layout, cu_seqlens_kv_padded=layout)
        padded = torch.tensor(layout, dtype=torch.int32, device=device)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=bin_size,
        max_seqlen_kv=bin_size,
        total_tokens=bin_size,
        host_offsets=host,
    )
    return params.validate()


def _edge_padded(lengths: Sequence[int], entries: int) -> tuple[int, ...]:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return tuple(offsets + [offsets[-1]] * (entries - len(offsets)))


def _carried_host_offsets(obj: Any) -> Any:
    """The host offsets :func:`to_megatron` kept beside ``obj``, while ``obj`` still holds the same tensors."""
    carried = getattr(obj, _HOST_OFFSETS_ATTR, None)
    if carried is None:
        return None
    host, tensors = carried
    if all(getattr(obj, name, None) is t for name, t in tensors.items()):
        return host
    return None


def _static_int(name: str, value: Any) -> int | None:
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, Tensor):
        if value.device.type != "cpu" or value.numel() != 1:
            raise PackedSeqParamsError(
                name, "must be a Python int (static)", "a device tensor needs a host sync to read; pass an int"
            )
        return int(value.item())
    raise PackedSeqParamsError(name, "must be an int", f"got {type(value).__name__}")


def _is_default(f: dataclasses.Field, value: Any) -> bool:
    if f.default is not dataclasses.MISSING:
        try:
            return bool(value == f.default)
        except Exception:  # tensors and other values with elementwise ==
            return False
    return False
