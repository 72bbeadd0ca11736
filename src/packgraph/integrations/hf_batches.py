"""Hugging Face batches as packgraph batches: ``DataCollatorWithFlattening`` output to and from ``PackedBatch``.

:func:`from_flattening_batch` turns a ``transformers.DataCollatorWithFlattening`` output into a fixed-shape
:class:`~packgraph.packing.PackedBatch`; :func:`to_flattening_batch` goes back. Both are host work on CPU tensors
(the collator's output), before anything reaches the GPU; neither needs transformers itself. Both are also
exported by :mod:`packgraph.integrations.hf`.

Label convention. HF's collator keeps labels *aligned with the inputs*: ``labels[i]`` is token ``i`` itself (or
-100), the first token of every document is -100, and the model shifts by one inside its loss. packgraph's
``PackedBatch.labels`` are *already shifted*: ``labels[i]`` is the target predicted at row ``i`` (the next token of
the same document), -100 on each document's last row and on rows outside every document. The conversions below
shift accordingly, so the same tokens are scored either way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

import torch
from torch import Tensor

from packgraph.buckets import BucketPolicy
from packgraph.packing import IGNORE_INDEX, PackedBatch
from packgraph.params import PackedSeqParams

__all__ = ["from_flattening_batch", "to_flattening_batch"]


def from_flattening_batch(
    batch: Mapping[str, Any],
    *,
    buckets: BucketPolicy | None = None,
    total_tokens: int | None = None,
    capacity: int | None = None,
    max_seqlen: int | None = None,
    pad_token_id: int = 0,
) -> PackedBatch:
    """A ``DataCollatorWithFlattening`` output as a fixed-shape ``PackedBatch`` (host work, CPU tensors).

    Args:
        batch: ``input_ids [1, N]`` and optionally ``labels [1, N]`` (HF convention: aligned with the inputs,
            -100 at each document start), ``position_ids [1, N]``, ``cu_seq_lens_q``, ``seq_idx``. Document
            boundaries come from ``cu_seq_lens_q``, else ``seq_idx``, else ``position_ids`` (a document starts
            wherever the position does not continue the previous one, as transformers detects packing), else the
            whole stream is one document.
        buckets: a ``BucketPolicy``: the params take its smallest bucket that fits (static ``max_seqlen`` and
            capacity), so batches share few graph signatures.
        total_tokens: the stream size ``T`` to pad to (static; default ``N``). Rows ``N..T-1`` belong to no
            document: token ``pad_token_id``, position 0, label -100.
        capacity, max_seqlen: static values when no ``buckets`` are given (default: the document count and the
            longest document).

    Returns:
        ``PackedBatch`` with ``tokens``, ``labels`` (shifted next-token targets, see the module docstring),
        ``loss_mask`` (``labels != -100``), ``position_ids``, all ``[T]``, and ``packed_seq_params`` on the CPU
        with host offsets (validation needs no sync). Move it with ``.to(device)``.

    Raises:
        ValueError: tensors not on the CPU, inconsistent lengths, ``N > total_tokens``.
    """
    input_ids = _host_row(batch["input_ids"], "input_ids")
    n = input_ids.numel()
    lengths = _document_lengths(batch, n)
    t = n if total_tokens is None else int(total_tokens)
    if t < n:
        raise ValueError(f"the batch has {n} tokens, more than total_tokens={t}: raise total_tokens or split it")
    starts = _starts(lengths)
    tokens = torch.full((t,), pad_token_id, dtype=torch.int64)
    tokens[:n] = input_ids
    if batch.get("labels") is not None:
        hf_labels = _host_row(batch["labels"], "labels", n)
    else:
        hf_labels = input_ids.clone()
    labels = torch.full((t,), IGNORE_INDEX, dtype=torch.int64)
    # HF scores token i+1 from row i (its loss shifts); packgraph stores that target at row i.
    labels[: max(n - 1, 0)] = hf_labels[1:n]
    # A document's last row has no next token inside it, whatever the collator's separator_id was.
    ends = [s + ln - 1 for s, ln in zip(starts, lengths, strict=True) if ln > 0]
    labels[ends] = IGNORE_INDEX
    position_ids = torch.zeros(t, dtype=torch.int64)
    if batch.get("position_ids") is not None:
        position_ids[:n] = _host_row(batch["position_ids"], "position_ids", n)
    else:
        position_ids[:n] = torch.cat([torch.arange(ln, dtype=torch.int64) for ln in lengths])
    if buckets is not None:
        params = PackedSeqParams.from_seqlens(lengths, total_tokens=t)
        params = buckets.apply(params)
    else:
        params = PackedSeqParams.from_seqlens(lengths, capacity=capacity, total_tokens=t, max_seqlen=max_seqlen)
    loss_mask = (labels != IGNORE_INDEX).to(torch.float32)
    # PackedBatch reads its target count from doc_lengths, assuming every next token is a target: only true when
    # the collator's labels masked nothing inside documents (e.g. no prompt masking).
    unmasked = int(loss_mask.sum()) == sum(max(ln - 1, 0) for ln in lengths)
    return PackedBatch(
        tokens=tokens,
        labels=labels,
        loss_mask=loss_mask,
        position_ids=position_ids,
        packed_seq_params=params,
        doc_lengths=tuple(lengths) if unmasked else None,
    )


def to_flattening_batch(
    packed_batch: PackedBatch,
    *,
    return_flash_attn_kwargs: bool = True,
    return_seq_idx: bool = False,
) -> dict[str, Any]:
    """A ``PackedBatch`` as ``DataCollatorWithFlattening`` would have produced it (the reverse conversion).

    Keeps only document rows (tail and padding rows are dropped), in document order. Offsets are read from the
    params' host offsets when known; otherwise they are copied to the host (one sync for device params).

    Returns:
        ``input_ids``, ``labels`` (HF convention: aligned with inputs, -100 at each document start),
        ``position_ids`` (restarting at 0), all int64 ``[1, N]``; with ``return_flash_attn_kwargs`` also int32
        ``cu_seq_lens_q``/``cu_seq_lens_k`` (real documents only) and int ``max_length_q``/``max_length_k`` (the
        true longest document); with ``return_seq_idx`` an int32 ``seq_idx [1, N]``. Tensors stay on the batch's
        device.
    """
    params = packed_batch.packed_seq_params
    real = _host_offsets(params, "cu_seqlens_q")
    layout = _host_offsets(params, "cu_seqlens_q_padded") if params.cu_seqlens_q_padded is not None else real
    lengths = [b - a for a, b in pairwise(real)]
    docs = [(s, ln) for s, ln in zip(layout, lengths, strict=False) if ln > 0]  # ghost slots hold no document
    device = packed_batch.tokens.device
    rows = _cat([torch.arange(s, s + ln, dtype=torch.int64) for s, ln in docs]).to(device)
    input_ids = packed_batch.tokens[rows].to(torch.int64)
    shifted = packed_batch.labels[rows].to(torch.int64)
    labels = torch.full_like(shifted, IGNORE_INDEX)
    labels[1:] = shifted[:-1]
    doc_starts = _starts([ln for _, ln in docs])
    labels[doc_starts] = IGNORE_INDEX
    position_ids = _cat([torch.arange(ln, dtype=torch.int64) for _, ln in docs])
    out: dict[str, Any] = {
        "input_ids": input_ids.view(1, -1),
        "labels": labels.view(1, -1),
        "position_ids": position_ids.to(device).view(1, -1),
    }
    if return_flash_attn_kwargs:
        cu = torch.tensor([0, *_cumsum([ln for _, ln in docs])], dtype=torch.int32, device=device)
        longest = max((ln for _, ln in docs), default=0)
        out.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    if return_seq_idx:
        seq_idx = _cat([torch.full((ln,), i, dtype=torch.int32) for i, (_, ln) in enumerate(docs)], torch.int32)
        out["seq_idx"] = seq_idx.to(device).view(1, -1)
    return out


def _host_row(x: Any, name: str, n: int | None = None) -> Tensor:
    t = torch.as_tensor(x)
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}: convert the collator output before moving it to the device")
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1 or (n is not None and t.numel() != n):
        want = "[1, N] or [N]" if n is None else f"[1, {n}] like input_ids"
        raise ValueError(f"{name} must be {want} (one flattened stream), got shape {tuple(t.shape)}")
    return t.to(torch.int64)


def _document_lengths(batch: Mapping[str, Any], n: int) -> list[int]:
    if batch.get("cu_seq_lens_q") is not None:
        offsets = _host_row(batch["cu_seq_lens_q"], "cu_seq_lens_q").tolist()
        if offsets[0] != 0 or offsets[-1] != n or any(b < a for a, b in pairwise(offsets)):
            raise ValueError(f"cu_seq_lens_q must rise from 0 to the {n} tokens of input_ids, got {offsets}")
        return [b - a for a, b in pairwise(offsets)]
    if n == 0:
        return []
    if batch.get("seq_idx") is not None:
        starts = _host_row(batch["seq_idx"], "seq_idx", n).diff() != 0
    elif batch.get("position_ids") is not None:
        starts = _host_row(batch["position_ids"], "position_ids", n).diff() != 1
    else:
        return [n]
    bounds = [0, *(torch.nonzero(starts).view(-1) + 1).tolist(), n]
    return [b - a for a, b in pairwise(bounds)]


def _host_offsets(params: PackedSeqParams, name: str) -> list[int]:
    host = params.current_host_offsets()
    if host is not None and name in host:
        return list(host[name])
    return getattr(params, name).tolist()


def _cat(parts: list[Tensor], dtype: torch.dtype = torch.int64) -> Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def _cumsum(values: Sequence[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def _starts(lengths: Sequence[int]) -> list[int]:
    return [0, *_cumsum(lengths)][:-1] if lengths else []
