"""Data parallelism over graphed layers: torch's ``DistributedDataParallel``, and an explicit all-reduce.

A graphed layer's backward returns its parameters' grads to autograd, whose ``AccumulateGrad`` nodes fire DDP's
hooks as eagerly, so DDP buckets, overlaps and reduces them as it does eager grads (tests/distributed/
test_ddp_graphs.py). :func:`summing_ddp` is DDP with a summing all-reduce, for losses normalised by the global
token count. :func:`allreduce_gradients` reduces after ``backward()`` instead, in buckets issued back to back (the
trainer's ``dp_engine="allreduce"``, kept to compare against DDP).

The recipe (each rank, one optimizer step)::

    batches = shard_batches(all_batches, rank, world)          # same deterministic order on every rank
    count = global_token_count(sum(b.num_real_tokens for b in step_batches), group, device=device)
    for b in step_batches:
        _, loss = model(b)                                      # the local masked mean over b's targets
        (loss * (b.num_real_tokens / count)).backward()         # -> sum over b's targets / global count
    allreduce_gradients(model.parameters(), group)              # SUM over ranks
    optimizer.step()

The weights make every target token count ``1 / global_count`` wherever it is, so the summed gradients equal
single-process training on the union of all ranks' batches. ``global_token_count`` is one small all-reduce per
step; the local count is known on the host (``PackedBatch.num_real_tokens`` reads ``doc_lengths``, the packer's
host offsets), so no device sync is needed to issue it, and its result stays on the device.

With context parallelism, the ranks of a CP group hold shards of the *same* batch: count each batch once (use
the unsharded batch's count on one CP rank and 0 on the others, or reduce over the DP group only) and reduce the
gradients over the DP x CP group.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["allreduce_gradients", "broadcast_parameters", "global_token_count", "shard_batches", "summing_ddp"]

T = TypeVar("T")


def shard_batches(batches: Iterable[T], rank: int, world: int, *, drop_last: bool = True) -> Iterator[T]:
    """This rank's batches: item ``rank`` of every consecutive group of ``world`` items, in order.

    Every rank must see the same ``batches`` in the same order (e.g. ``batches_from_corpus`` over the same
    documents: packing is deterministic). Items are taken lazily; the others are skipped (a lazy
    ``CorpusBatches`` still builds them; shard the bins of a ``Packing`` instead to avoid that).

    Args:
        drop_last: drop a last, incomplete group so every rank runs the same number of steps (the default;
            ranks that run different step counts deadlock in the gradient all-reduce). With ``False`` the
            ranks past the end of the last group get one item fewer.
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")
    it = iter(batches)
    while True:
        group = list(itertools.islice(it, world))
        if len(group) < world and (drop_last or len(group) <= rank):
            return
        yield group[rank]


def global_token_count(
    local_count: int | Tensor, group: Any = None, *, device: torch.device | str | None = None
) -> Tensor:
    """Sum of every rank's count of real target tokens: int64 scalar tensor on ``device``.

    One small all-reduce (8 bytes). Pass the host-known count (``PackedBatch.num_real_tokens``) so issuing it
    needs no device sync; the result stays on the device, ready to divide a loss. ``device`` defaults to the
    tensor's device, else CUDA's current device for an NCCL group and the CPU for gloo.
    """
    if isinstance(local_count, Tensor):
        count = local_count.detach().to(torch.int64).reshape(())
        if device is not None:
            count = count.to(device)
        else:
            count = count.clone()
    else:
        count = torch.tensor(int(local_count), dtype=torch.int64, device=device or _default_device(group))
    if _world(group) > 1:
        dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return count


def allreduce_gradients(
    parameters: Iterable[nn.Parameter] | nn.Module,
    group: Any = None,
    *,
    average: bool = False,
    bucket_cap_mb: float = 25.0,
    every_rank_has_grads: bool = False,
    single_rank_too: bool = False,
) -> None:
    """Sum (or average) every parameter's ``.grad`` across ``group``, in place, after ``backward()``.

    Gradients are flattened into buckets of at most ``bucket_cap_mb`` per dtype and device (one all-reduce each)
    and copied back into the existing ``.grad`` tensors (their storage is kept: a graph that accumulates into
    them stays valid). Parameters that require grad but have ``.grad is None`` on this rank get a zero gradient,
    so every rank issues the same buckets (a mismatch would hang); a parameter no rank produced a gradient for
    gets ``.grad = None`` back, as in single-process training (an optimizer skips it: no weight decay, no
    momentum step). Finding those costs one all-reduce of a flag per parameter and one small device-to-host
    read per call. Tied parameters are reduced once.

    Args:
        parameters: a module or its parameters, in the same order on every rank.
        average: divide by the group size (DDP's convention); the default sums, for losses already normalised
            by the global token count (module docstring).
        every_rank_has_grads: the caller knows every rank produced a grad for every parameter that requires one
            (each rank runs the whole model): the flag all-reduce and its device-to-host read are skipped.
        single_rank_too: run the collectives in a group of one too (a summing reduction there is the identity,
            and is skipped by default): what a benchmark of the reduction's cost at world size 1 measures.
    """
    params = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
    unique = list({id(p): p for p in params if p.requires_grad}.values())
    world = _world(group)
    if world == 1 and not average and not single_rank_too:
        return
    if not unique:
        return
    had_grad = [p.grad is not None for p in unique]
    used_anywhere = had_grad
    if world > 1 and every_rank_has_grads:
        used_anywhere = [True] * len(unique)
    elif world > 1:
        flags = torch.tensor(had_grad, dtype=torch.int32, device=unique[0].device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        used_anywhere = [bool(f) for f in flags.tolist()]
    for p, has in zip(unique, had_grad, strict=True):
        if not has:
            p.grad = torch.zeros_like(p)
    cap = max(int(bucket_cap_mb * 2**20), 1)
    for bucket in _buckets([p.grad for p in unique], cap):
        flat = _flatten_dense_tensors(bucket)
        if world > 1 or single_rank_too:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        if average:
            flat.div_(world)
        for grad, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
            grad.copy_(reduced)
    for p, used in zip(unique, used_anywhere, strict=True):
        if not used:
            p.grad = None


def summing_ddp(module: nn.Module, *, group: Any = None, **ddp_kwargs: Any) -> nn.Module:
    """``DistributedDataParallel(module, process_group=group, **ddp_kwargs)`` whose gradient all-reduce sums.

    DDP averages over the ranks; a loss already divided by the global target count (module docstring) needs the
    sum, and a summing hook keeps it exact at any world size (scaling the loss by the world size would not be for
    a world of 3). Everything else is DDP's: buckets, overlap with the backward, ``no_sync()``, ``static_graph``,
    ``find_unused_parameters``. ``gradient_as_bucket_view`` defaults to ``True`` here: the ``.grad`` tensors are
    views of DDP's buckets rather than a second copy of every gradient (pass ``False`` for DDP's default).
    """
    from torch.nn.parallel import DistributedDataParallel

    ddp_kwargs.setdefault("gradient_as_bucket_view", True)
    ddp = DistributedDataParallel(module, process_group=group, **ddp_kwargs)
    ddp.register_comm_hook(group, _sum_hook)
    return ddp


# No annotations: DDP checks a hook's against dist.GradBucket, and this module's are strings (PEP 563).
def _sum_hook(group, bucket):  # noqa: ANN001, ANN202
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def broadcast_parameters(module: nn.Module, *, src: int = 0, group: Any = None) -> None:
    """Copy ``src``'s parameters and buffers to every rank of ``group`` (identical starting weights).

    ``src`` is a global rank. One broadcast per tensor: parameters, then buffers, in module order (the same on
    every rank).
    """
    if _world(group) == 1:
        return
    with torch.no_grad():
        for t in itertools.chain(module.parameters(), module.buffers()):
            dist.broadcast(t.data, src=src, group=group)


def _buckets(grads: Sequence[Tensor], cap_bytes: int) -> Iterator[list[Tensor]]:
    """Consecutive runs of same-(dtype, device) tensors, each at most ``cap_bytes`` (a bigger tensor goes alone)."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for g in grads:
        if g.is_sparse:
            raise ValueError("allreduce_gradients: sparse gradients are not supported")
        by_kind.setdefault((g.dtype, g.device), []).append(g)
    for tensors in by_kind.values():
        bucket: list[Tensor] = []
        size = 0
        for g in tensors:
            nbytes = g.numel() * g.element_size()
            if bucket and size + nbytes > cap_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(g)
            size += nbytes
        if bucket:
            yield bucket


def _world(group: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _default_device(group: Any) -> torch.device:
    if _world(group) > 1 and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
