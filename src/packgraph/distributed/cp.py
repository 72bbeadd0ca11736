"""Context parallelism for packed (THD) streams: load-balanced sharding and all-gather K/V attention.

A batch of ``T`` rows is split over the ``CP`` ranks of a ``cp_group``. Every sequence (its *padded* length, a
multiple of ``2 * CP``: build the batch with ``pad_to_multiple = 2 * CP``) is cut into ``2 * CP`` equal chunks;
rank ``r`` holds chunk ``r`` and chunk ``2 * CP - 1 - r``. Under causal attention chunk ``j`` costs about ``j + 1``
units, so every rank gets the same work (``2 * CP + 1`` units per sequence). The tail rows past the last offset
are chunked the same way (as one more dead segment), so the ranks' local rows partition ``[0, T)`` exactly.

Local layout on rank ``r``: ``T / CP`` rows; sequence ``i`` occupies local rows ``[padded[i] / CP, padded[i + 1] /
CP)``, its chunk ``r`` first, then its chunk ``2 * CP - 1 - r``. A sequence's real tokens always form a prefix of
its local rows (padding sits at the sequence end, and a rank's second chunk is real only when its first one is
full), so the local params are ordinary padded-layout :class:`PackedSeqParams`:

* ``cu_seqlens_q_padded = cu_seqlens_kv_padded = padded / CP`` (always present), ``cu_seqlens_q = cu_seqlens_kv``
  = offsets of the local real lengths;
* ``max_seqlen_q = max_seqlen_kv = roundup(max_seqlen, 2 * CP) / CP`` (static; bounds every local length);
* ``total_tokens = T / CP``, ``local_cp_size = CP``, ``cp_group`` set: both static, in the graph signature.

:func:`cp_varlen_attention` recovers the global layout from these alone (``padded = local_padded * CP``,
``T = T_local * CP``, the rank from the group), so nothing else crosses a graph boundary.

Everything derived from offsets is computed on the device with fixed shapes (searchsorted, gather); the only
host work reads static ints. The collectives (all-gather forward, reduce-scatter backward) are plain
``torch.distributed`` calls on the caller's stream: NCCL captures them in a CUDA graph, provided the
communicator already exists (a warm-up call before capture, which :func:`packgraph.capture` does anyway).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from packgraph.ops import varlen_attention
from packgraph.params import PackedSeqParams, PackedSeqParamsError, slot_of_rows

if TYPE_CHECKING:
    from packgraph.packing import PackedBatch

__all__ = [
    "CPShard",
    "all_gather_autograd",
    "cp_position_ids",
    "cp_shard_index",
    "cp_varlen_attention",
    "shard_thd_for_cp",
]


# ---------------------------------------------------------------------------------------------------- collectives
def _all_gather_into(out: Tensor, inp: Tensor, group: Any) -> None:
    # torch >= 2.13 renames the op and deprecates the old name; older torch (2.11 on the GPU box) has only the old.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter_into(out: Tensor, inp: Tensor, group: Any) -> None:
    if dist.get_backend(group) == "gloo":
        # gloo has no reduce-scatter of its own: torch completes one with a split and a copy_ outside the
        # collective's op, which a recorded op log then replays as if they were the caller's. An all-reduce and
        # this rank's slice are the same sum, in ops of their own.
        total = inp.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        out.copy_(total.view(dist.get_world_size(group), *out.shape)[dist.get_rank(group)])
        return
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=dist.ReduceOp.SUM, group=group)


class _AllGather(torch.autograd.Function):
    """Concatenate every rank's ``[n, ...]`` along dim 0; the backward reduce-scatters (sums) the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        _all_gather_into(out, x.contiguous(), group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        world = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
        # Every rank's loss depends on every rank's rows: a rank's gradient is the sum over the group.
        _reduce_scatter_into(out, grad.contiguous(), ctx.group)
        return out, None


def all_gather_autograd(x: Tensor, group: Any = None) -> Tensor:
    """``[n, ...]`` on each rank -> ``[world * n, ...]`` (rank-major), differentiable.

    The backward is a reduce-scatter (sum) of the gradient, so each rank gets the total gradient of its own rows.
    Same shape on every rank; graph-capturable on NCCL.
    """
    return _AllGather.apply(x, group)


# ---------------------------------------------------------------------------------------------------- index math
class _Chunks(NamedTuple):
    """Per local row (``[T / CP]``, int64): the segment holding it, and its chunk size and offset in the segment."""

    segment: Tensor  # slot index; ``capacity`` for the tail
    chunk: Tensor  # size of one of the segment's 2 * CP chunks
    offset: Tensor  # row - local start of the segment, in [0, 2 * chunk)
    global_start: Tensor  # global start row of the segment


def _extended_offsets(layout: Tensor, total_tokens: int) -> Tensor:
    """Global layout offsets with ``T`` appended: the tail becomes one more segment. int64 ``[capacity + 2]``."""
    layout = layout.long()
    return torch.cat([layout, torch.full((1,), total_tokens, dtype=torch.long, device=layout.device)])


def _local_chunks(global_offsets: Tensor, cp_size: int, local_rows: int) -> _Chunks:
    """Where each local row sits; identical on every rank (the local layout does not depend on the rank)."""
    local_offsets = global_offsets // cp_size
    rows = torch.arange(local_rows, device=global_offsets.device)
    segment = slot_of_rows(local_offsets, rows)
    chunk = (global_offsets[1:] - global_offsets[:-1]) // (2 * cp_size)
    return _Chunks(segment, chunk[segment], rows - local_offsets[segment], global_offsets[segment])


def _position_in_sequence(chunks: _Chunks, cp_rank: Tensor | int, cp_size: int) -> Tensor:
    """Position of each local row within its (global) segment on rank ``cp_rank`` (broadcasts over ranks)."""
    first = chunks.offset < chunks.chunk
    chunk_id = torch.where(first, cp_rank, 2 * cp_size - 1 - cp_rank)
    return chunk_id * chunks.chunk + chunks.offset - torch.where(first, 0, chunks.chunk)


def cp_shard_index(
    packed_seq_params: PackedSeqParams, cp_rank: int, cp_size: int, total_tokens: int | None = None
) -> Tensor:
    """The global row of each of rank ``cp_rank``'s ``T / CP`` local rows: int64 ``[T / CP]`` on the params' device.

    ``x_local = x.index_select(0, index)`` shards any ``[T, ...]`` tensor. Over all ranks the indices partition
    ``[0, T)``. Computed on the device, no host sync. Needs every layout length and ``T`` divisible by ``2 * CP``
    (checked by :func:`shard_thd_for_cp` when host offsets are known).
    """
    T = _total_tokens(packed_seq_params, total_tokens)
    _check_cp(cp_rank, cp_size, T)
    offsets = _extended_offsets(packed_seq_params.layout_offsets("q"), T)
    chunks = _local_chunks(offsets, cp_size, T // cp_size)
    return chunks.global_start + _position_in_sequence(chunks, cp_rank, cp_size)


def cp_position_ids(packed_seq_params: PackedSeqParams, total_tokens: int | None = None) -> Tensor:
    """Global RoPE positions ``[T_local]`` int64 of the local rows, from *local* CP params and the group rank.

    Real rows get their position in the whole (unsharded) sequence; dead rows (padding, tail) get 0, as
    :class:`~packgraph.packing.PackedBatch` does. No host sync. Equals the ``position_ids`` that
    :func:`shard_thd_for_cp` returns, so a layer can derive them itself instead of taking an extra input.

    Args:
        total_tokens: the local row count ``T / CP``; defaults to the params' (``attention_view`` drops it).
    """
    cp_size, group = _cp_of(packed_seq_params)
    rank = dist.get_rank(group)
    T_local = _total_local(packed_seq_params, total_tokens)
    offsets = _extended_offsets(_local_layout(packed_seq_params), T_local) * cp_size
    chunks = _local_chunks(offsets, cp_size, T_local)
    live = _local_live(packed_seq_params, chunks)
    return torch.where(live, _position_in_sequence(chunks, rank, cp_size), 0)


def _local_live(local_params: PackedSeqParams, chunks: _Chunks) -> Tensor:
    """Local rows holding real tokens: the real tokens are a prefix of each segment's local rows."""
    cu = local_params.cu_seqlens_q.long()
    lengths = torch.cat([cu[1:] - cu[:-1], cu.new_zeros(1)])  # the tail segment has no real rows
    return chunks.offset < lengths[chunks.segment]


# ---------------------------------------------------------------------------------------------------- sharding
class CPShard(NamedTuple):
    """What :func:`shard_thd_for_cp` returns.

    Attributes:
        data: the local tensor(s) (``[T / CP, ...]``) or local :class:`~packgraph.packing.PackedBatch`.
        packed_seq_params: the local params (module docstring).
        position_ids: int64 ``[T / CP]`` global positions for RoPE (0 on dead rows).
    """

    data: Any
    packed_seq_params: PackedSeqParams
    position_ids: Tensor


def shard_thd_for_cp(
    tensor_or_batch: Tensor | Sequence[Tensor] | PackedBatch,
    packed_seq_params: PackedSeqParams | None,
    cp_rank: int,
    cp_size: int,
    *,
    cp_group: Any = None,
) -> CPShard:
    """Rank ``cp_rank``'s share of a packed batch under load-balanced ``2 * CP`` chunking (module docstring).

    Args:
        tensor_or_batch: a ``[T, ...]`` tensor, a sequence of them, or a ``PackedBatch`` (its tokens, labels,
            loss_mask and position_ids are sharded; ``doc_lengths`` is dropped, since documents are split:
            normalise the loss by the *unsharded* batch's ``num_real_tokens``).
        packed_seq_params: the global params (``None``: the batch's). Every layout length (padded twin when
            present) and ``T`` must be multiples of ``2 * CP``: use ``pad_to_multiple = 2 * CP``.
        cp_rank, cp_size: this rank's index in the CP group and the group size.
        cp_group: the process group the attention all-gathers over; ``None`` means the default group when it is
            initialised with ``cp_size`` ranks (else stays ``None``: enough for sharding data, not for attention).

    Returns:
        :class:`CPShard` ``(data, packed_seq_params, position_ids)``. Index math runs on the params' device with
        fixed shapes (no sync); the local params carry host offsets (hence validate without a sync) when the
        global ones do.

    Raises:
        PackedSeqParamsError: already-sharded params, ``T`` or (host-known) lengths not divisible by ``2 * CP``,
            or a padded length above ``roundup(max_seqlen_q, 2 * CP)``.
        ValueError: bad rank/size, or tensors whose first dim is not ``T``.
    """
    from packgraph.packing import PackedBatch

    batch = tensor_or_batch if isinstance(tensor_or_batch, PackedBatch) else None
    params = packed_seq_params if packed_seq_params is not None else getattr(batch, "packed_seq_params", None)
    if params is None:
        raise ValueError("shard_thd_for_cp: packed_seq_params is required with tensors (or pass a PackedBatch)")
    if params.local_cp_size is not None and params.local_cp_size > 1:
        raise PackedSeqParamsError(
            "local_cp_size", "params are already sharded", f"local_cp_size={params.local_cp_size}"
        )
    T = _total_tokens(params, batch.tokens.shape[0] if batch is not None else _first_dim(tensor_or_batch))
    _check_cp(cp_rank, cp_size, T)
    host = _local_host_offsets(params, cp_rank, cp_size)
    group = _resolve_group(cp_group, cp_size)

    offsets = _extended_offsets(params.layout_offsets("q"), T)
    chunks = _local_chunks(offsets, cp_size, T // cp_size)
    pos = _position_in_sequence(chunks, cp_rank, cp_size)
    index = chunks.global_start + pos

    # Local real length of each slot: the real part of chunk r plus the real part of chunk 2CP-1-r.
    cu = params.cu_seqlens_q.long()
    length = cu[1:] - cu[:-1]
    c = (offsets[1:-1] - offsets[:-2]) // (2 * cp_size)
    first = (length - cp_rank * c).clamp(min=0).minimum(c)
    second = (length - (2 * cp_size - 1 - cp_rank) * c).clamp(min=0).minimum(c)
    local_cu = torch.cat([cu.new_zeros(1), torch.cumsum(first + second, 0)]).to(torch.int32)
    local_layout = (offsets[:-1] // cp_size).to(torch.int32)
    max_seqlen = _round_up(params.max_seqlen_q, 2 * cp_size) // cp_size
    local = PackedSeqParams(
        qkv_format=params.qkv_format,
        cu_seqlens_q=local_cu,
        cu_seqlens_kv=local_cu,
        cu_seqlens_q_padded=local_layout,
        cu_seqlens_kv_padded=local_layout,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        local_cp_size=cp_size,
        cp_group=group,
        total_tokens=T // cp_size,
        host_offsets=host,
        short_docs_min_slots=params.short_docs_min_slots,
    )
    local.validate()
    live = _local_live(local, chunks)
    position_ids = torch.where(live, pos, 0)

    if batch is not None:
        data = PackedBatch(
            tokens=batch.tokens.index_select(0, index.to(batch.tokens.device)),
            labels=batch.labels.index_select(0, index.to(batch.labels.device)),
            loss_mask=batch.loss_mask.index_select(0, index.to(batch.loss_mask.device)),
            position_ids=batch.position_ids.index_select(0, index.to(batch.position_ids.device)),
            packed_seq_params=local,
            doc_lengths=None,
        )
    elif isinstance(tensor_or_batch, Tensor):
        data = tensor_or_batch.index_select(0, index.to(tensor_or_batch.device))
    else:
        data = type(tensor_or_batch)(t.index_select(0, index.to(t.device)) for t in tensor_or_batch)
    return CPShard(data, local, position_ids)


def _local_host_offsets(params: PackedSeqParams, cp_rank: int, cp_size: int) -> dict[str, tuple[int, ...]] | None:
    """Host copies of the local offsets, and the divisibility/max_seqlen checks, when the host knows the offsets
    (``host_offsets``, or CPU tensors)."""
    layout_name = "cu_seqlens_q_padded" if params.cu_seqlens_q_padded is not None else "cu_seqlens_q"
    host = params.current_host_offsets() or {}
    if layout_name in host and "cu_seqlens_q" in host:
        layout, cu = host[layout_name], host["cu_seqlens_q"]
    elif params.device.type == "cpu":
        layout, cu = getattr(params, layout_name).tolist(), params.cu_seqlens_q.tolist()
    else:
        return None  # device-only offsets: checking them would cost a sync
    n = 2 * cp_size
    bound = _round_up(params.max_seqlen_q, n)
    local_cu = [0]
    for i in range(len(layout) - 1):
        padded, length = layout[i + 1] - layout[i], cu[i + 1] - cu[i]
        if padded % n:
            raise PackedSeqParamsError(
                layout_name,
                f"each sequence's layout length must be a multiple of 2*CP={n}",
                f"slot {i} has {padded}; build the batch with pad_to_multiple={n}",
            )
        if padded > bound:
            raise PackedSeqParamsError(
                "max_seqlen_q",
                f"must bound every padded length (up to a multiple of 2*CP={n})",
                f"slot {i} is padded to {padded} > roundup({params.max_seqlen_q}, {n}) = {bound}; "
                "pad to the smallest multiple, or raise max_seqlen",
            )
        c = padded // n
        local_cu.append(
            local_cu[-1] + min(c, max(0, length - cp_rank * c)) + min(c, max(0, length - (n - 1 - cp_rank) * c))
        )
    local_layout = tuple(o // cp_size for o in layout)
    local_cu = tuple(local_cu)
    return {
        "cu_seqlens_q": local_cu,
        "cu_seqlens_kv": local_cu,
        "cu_seqlens_q_padded": local_layout,
        "cu_seqlens_kv_padded": local_layout,
    }


def _resolve_group(cp_group: Any, cp_size: int) -> Any:
    if cp_group is not None:
        if dist.get_world_size(cp_group) != cp_size:
            raise ValueError(f"cp_group has {dist.get_world_size(cp_group)} ranks but cp_size is {cp_size}")
        return cp_group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == cp_size:
        return dist.group.WORLD
    return None


# ---------------------------------------------------------------------------------------------------- attention
def cp_varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    packed_seq_params: PackedSeqParams,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> Tensor:
    """Causal varlen attention of this rank's query rows against the whole sequences, across the CP group.

    Takes the *local* q ``[T/CP, Hq, D]``, k/v ``[T/CP, Hkv, D]`` and local params from :func:`shard_thd_for_cp`
    (``local_cp_size`` and ``cp_group`` set); returns the local output ``[T/CP, Hq, D]``, equal to the rows of
    unsharded attention that this rank holds. Dead rows (padding, tail) are exact zeros with zero gradients.

    Steps: one all-gather of K and V (concatenated, so one collective; its backward is one reduce-scatter);
    then one :func:`~packgraph.ops.varlen_attention` call where each local query chunk ``j`` of a sequence is a
    q segment and the global prefix ``[0, (j + 1) * chunk)`` of that sequence is its kv segment, so
    FlashAttention's bottom-right causal alignment gives exactly the global causal mask. The prefixes overlap,
    so they are gathered into a kv stream of ``(2 * CP + 1) / (2 * CP) * T`` rows (static).

    Padding rows are safe to include in the segments: padding follows a sequence's real tokens, so causally no
    real query sees it; padding query rows are zeroed afterwards.

    Graph-safe: no host sync; ``local_cp_size``, ``cp_group`` and the max seqlens are static. All ranks of the
    group must call it in the same order (one collective each way).

    Raises:
        NotImplementedError: ``causal=False`` (a non-causal query needs the whole sequence's real length, which
            the local params do not carry).
        PackedSeqParamsError: params that are not local CP params.
    """
    if not causal:
        raise NotImplementedError(
            "cp_varlen_attention supports causal attention only; non-causal CP needs the global real lengths"
        )
    cp_size, group = _cp_of(packed_seq_params)
    T_local = _total_local(packed_seq_params, q.shape[0])
    rank = dist.get_rank(group)
    T = T_local * cp_size
    device = q.device
    offsets = _extended_offsets(_local_layout(packed_seq_params), T_local) * cp_size  # global, tail appended
    chunks = _local_chunks(offsets, cp_size, T_local)

    # 1. Gather K/V from every rank (rank-major), then learn where each global row landed in the gathered tensor.
    if k.shape != v.shape:
        raise ValueError(f"cp_varlen_attention: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    hkv = k.shape[1]
    gathered = all_gather_autograd(torch.cat([k, v], dim=1), group)  # one collective for both
    ranks = torch.arange(cp_size, device=device)[:, None]
    rows_of_rank = chunks.global_start + _position_in_sequence(chunks, ranks, cp_size)  # [CP, T_local]
    where_is = torch.empty(T, dtype=torch.long, device=device)
    where_is[rows_of_rank.reshape(-1)] = torch.arange(T, device=device)

    # 2. Segments: local query chunk (r, then 2CP-1-r) of each slot; kv = that chunk's global causal prefix.
    capacity = offsets.numel() - 2
    chunk = (offsets[1 : capacity + 1] - offsets[:capacity]) // (2 * cp_size)  # [capacity]
    q_cu = _interleaved_offsets(chunk, chunk)
    kv_cu = _interleaved_offsets((rank + 1) * chunk, (2 * cp_size - rank) * chunk)
    T_kv = (2 * cp_size + 1) * T // (2 * cp_size)
    kv_rows = torch.arange(T_kv, device=device)
    kv_segment = slot_of_rows(kv_cu, kv_rows)
    live_kv = kv_segment < 2 * capacity
    slot = (kv_segment // 2).clamp(max=max(capacity - 1, 0))
    global_row = offsets[slot] + kv_rows - kv_cu[kv_segment.clamp(max=2 * capacity - 1)]
    source = where_is[torch.where(live_kv, global_row, 0)]

    stream = gathered.index_select(0, source)
    k_stream, v_stream = stream[:, :hkv], stream[:, hkv:]

    max_chunk = -(-packed_seq_params.max_seqlen_q // 2)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=q_cu.to(torch.int32),
        cu_seqlens_kv=kv_cu.to(torch.int32),
        max_seqlen_q=max_chunk,
        max_seqlen_kv=(2 * cp_size - rank) * max_chunk,
    )
    out = varlen_attention(q, k_stream, v_stream, params, causal=True, softmax_scale=softmax_scale)
    # Padding query rows attended to their own prefix; they are dead, so select zeros (not multiply: no NaN leaks).
    live = _local_live(packed_seq_params, chunks)
    return torch.where(live[:, None, None], out, 0)


def _interleaved_offsets(first: Tensor, second: Tensor) -> Tensor:
    """``[0, f0, f0 + s0, f0 + s0 + f1, ...]``: offsets of segments alternating first/second per slot."""
    sizes = torch.stack([first, second], dim=1).reshape(-1)
    return torch.cat([sizes.new_zeros(1), torch.cumsum(sizes, 0)])


# ---------------------------------------------------------------------------------------------------- helpers
def _cp_of(params: PackedSeqParams) -> tuple[int, Any]:
    cp_size = params.local_cp_size
    if cp_size is None or params.cu_seqlens_q_padded is None:
        raise PackedSeqParamsError(
            "local_cp_size", "not local context-parallel params", "build them with shard_thd_for_cp"
        )
    group = params.cp_group
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise PackedSeqParamsError("cp_group", "required for context-parallel attention (no default group)")
        group = dist.group.WORLD
    if dist.get_world_size(group) != cp_size:
        raise PackedSeqParamsError(
            "local_cp_size", "must equal the cp_group size", f"{cp_size} vs {dist.get_world_size(group)}"
        )
    return cp_size, group


def _local_layout(params: PackedSeqParams) -> Tensor:
    return params.cu_seqlens_q_padded


def _total_local(params: PackedSeqParams, rows: int | None) -> int:
    """The local row count: ``rows`` (a tensor's first dim) checked against the params' ``total_tokens``."""
    if rows is None:
        rows = params.total_tokens
        if rows is None:
            raise PackedSeqParamsError("total_tokens", "required on local context-parallel params (T / CP)")
    elif params.total_tokens is not None and params.total_tokens != rows:
        raise ValueError(f"the tensors have {rows} local rows but the local params say {params.total_tokens}")
    return rows


def _total_tokens(params: PackedSeqParams, fallback: int | None) -> int:
    T = params.total_tokens if params.total_tokens is not None else fallback
    if T is None:
        raise PackedSeqParamsError("total_tokens", "required to shard (or pass a tensor whose first dim is T)")
    if fallback is not None and params.total_tokens is not None and fallback != params.total_tokens:
        raise ValueError(f"tensors have {fallback} rows but total_tokens is {params.total_tokens}")
    return T


def _first_dim(x: Tensor | Sequence[Tensor]) -> int:
    if isinstance(x, Tensor):
        return x.shape[0]
    rows = {t.shape[0] for t in x}
    if len(rows) != 1:
        raise ValueError(f"all tensors must have the same first dim T, got {sorted(rows)}")
    return rows.pop()


def _check_cp(cp_rank: int, cp_size: int, total_tokens: int) -> None:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"need 0 <= cp_rank < cp_size, got cp_rank={cp_rank}, cp_size={cp_size}")
    if total_tokens % (2 * cp_size):
        raise PackedSeqParamsError("total_tokens", f"must be a multiple of 2*CP={2 * cp_size}", f"T={total_tokens}")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
