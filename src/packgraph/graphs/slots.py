"""The hidden-state grad buffers of a chained layer stack, allocated only while a backward pass uses them.

A chained stack's backward graphs pass the grad of the hidden states from layer to layer through two fixed buffers
per layout, slots 0 and 1: the last layer reads slot 1 (the grad of the stack's output, copied in) and writes slot 0,
the layer before reads slot 0 and writes slot 1, and so on. Eager holds such grads only during its backward. Kept
allocated for good, the two buffers would sit on top of eager's peak, which training reaches at the end of the
forward.

So on CUDA both slots of a layout share one block, the only block of a :class:`torch.cuda.MemPool` of its own.
:meth:`ChainGradSlots.lend` allocates it before a backward replay or capture, and :meth:`ChainGradSlots.give_back`
frees it before a forward, when nothing handed out on it is still held. Nothing else is ever allocated in that pool,
and the block is allocated on one stream with one size, so it comes back at the address the graphs write. Every
lend checks that address. While the block is given back, its memory stays reserved by the pool, as eager's freed
grads stay reserved by the caching allocator.

Without that API (a CPU stand-in, a torch without ``MemPool``) each slot is its own tensor and stays allocated. A
slot given back there is filled with NaN (floating dtypes), so a stand-in run that read a slot across a forward
fails loudly instead of passing where CUDA makes no promise about the contents.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from packgraph.graphs.handouts import KEPT_FOR_HOLDERS, Handout

__all__ = ["ChainGradSlots", "release_spare_pools"]

# The pools of closed groups' blocks, by (device, segment size), for the next block of that segment size. A pool
# destroyed by the garbage collector aborted the process once (inside a warm-up that routes allocations to a graph
# pool, with the pool's block still allocated), so pools are destroyed only by release_spare_pools(), at a point the
# caller chooses.
_SPARE_POOLS: dict[tuple[torch.device, int], list[Any]] = {}
# One allocation stream per device for every block: the allocator reuses a free block only on the stream it was
# allocated on, and a spare pool's block must be reusable by the next group.
_ALLOC_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def release_spare_pools() -> None:
    """Destroy the memory pools that closed capture groups left for reuse, which releases the memory they reserve.
    Call it between runs (after dropping the graphs and a ``gc.collect()``), not during a capture or warm-up;
    ``packgraph.bench`` calls it between methods."""
    if _SPARE_POOLS:
        torch.cuda.synchronize()
        _SPARE_POOLS.clear()


def _take_pool(device: torch.device, nbytes: int) -> Any:
    spares = _SPARE_POOLS.get((device, nbytes))
    if spares:
        torch.cuda.synchronize(device)  # the closed group's last replays may still use the block
        return spares.pop()
    with torch.cuda.device(device):
        return torch.cuda.MemPool()


def _alloc_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _ALLOC_STREAMS.get(device)
    if stream is None:
        stream = _ALLOC_STREAMS[device] = torch.cuda.Stream(device)
    return stream


OUTSIDE_POOLS = object()  # the pool of a slot: no graph pool, so no capture may place tensors on it

# The caching allocator gives a request of 10 MiB or more a segment of exactly its size rounded up to 2 MiB; a
# smaller one would get a 20 MiB segment. So the pool's one segment is made by a request of at least 10 MiB, and
# the block is then carved from it at its own size: the allocator splits a free block when more than 1 MiB would
# be left over (else it hands out the whole block, which the allocated statistic then counts).
_MIN_EXACT_SEGMENT = 10 * 2**20
_SEGMENT_ROUNDING = 2 * 2**20
_SPLIT_REMAINDER = 2**20
_ALIGN = 512


def _span_bytes(like: Tensor) -> int:
    """Bytes a tensor of ``like``'s shape and strides spans in its storage."""
    if like.numel() == 0:
        return 0
    last = sum((n - 1) * s for n, s in zip(like.shape, like.stride(), strict=True))
    return (last + 1) * like.element_size()


@contextlib.contextmanager
def _no_memory_fill() -> Iterator[None]:
    """``torch.utils.deterministic.fill_uninitialized_memory`` off in the block (it fills only under deterministic
    algorithms)."""
    deterministic = getattr(torch.utils, "deterministic", None)
    if deterministic is None or not getattr(deterministic, "fill_uninitialized_memory", False):
        yield
        return
    deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        deterministic.fill_uninitialized_memory = True


def _lending_api() -> bool:
    return hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")


class _Block:
    """The memory of both slots of one layout, lent from a pool of its own (CUDA)."""

    def __init__(self, like: Tensor) -> None:
        # First in the instance dict, so freed before the pool even if close() never ran: a MemPool destroyed
        # under a live allocation leaves the allocator a block of a pool it no longer has.
        self.memory: Tensor | None = None
        slot = math.ceil(_span_bytes(like) / _ALIGN) * _ALIGN
        self.segment_bytes = math.ceil(max(2 * slot, _MIN_EXACT_SEGMENT) / _SEGMENT_ROUNDING) * _SEGMENT_ROUNDING
        split = self.segment_bytes - 2 * slot > _SPLIT_REMAINDER
        # What a lend allocates, as the allocated statistic counts it.
        self.nbytes = 2 * slot if split else self.segment_bytes
        self.device = like.device
        self.stream = _alloc_stream(self.device)
        self.pool = _take_pool(self.device, self.segment_bytes)
        primer = self._allocate(self.segment_bytes)  # makes the segment (a spare pool has it already, free)
        del primer
        self.memory = self._allocate()
        self.ptr = self.memory.data_ptr()
        self.slot_bytes = slot
        self.statics = [self._view(like, k) for k in (0, 1)]
        with torch.no_grad():
            for s in self.statics:
                s.zero_()

    def _allocate(self, nbytes: int | None = None) -> Tensor:
        # Allocated on the block's own stream, but written and read by the graphs on the caller's, in no order with
        # it: nothing may run on that stream. With deterministic algorithms on, torch.empty fills new memory (0xFF
        # bytes here) with a kernel on the current stream, which a busy GPU ran in the middle of the next backward
        # replay, turning the hidden-state grads to NaN. The graphs write every slot before they read it, so the
        # fill is skipped; and the caller's stream waits for the block's, should anything else ever run there.
        with _no_memory_fill(), torch.cuda.use_mem_pool(self.pool, self.device), torch.cuda.stream(self.stream):
            block = torch.empty(nbytes or self.nbytes, dtype=torch.uint8, device=self.device)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return block

    def _view(self, like: Tensor, k: int) -> Tensor:
        # A storage over the slot's bytes that does not own them: the block's memory tensor does, while lent.
        ptr = self.ptr + k * self.slot_bytes
        storage = torch._C._construct_storage_from_data_pointer(ptr, self.device, self.slot_bytes)
        return torch.empty(0, dtype=like.dtype, device=self.device).set_(storage, 0, like.shape, like.stride())

    def close(self) -> None:
        """Free the block and keep its pool for the next block of its size (see ``_SPARE_POOLS``)."""
        self.memory = None
        if self.pool is not None:
            _SPARE_POOLS.setdefault((self.device, self.segment_bytes), []).append(self.pool)
            self.pool = None

    def lend(self) -> None:
        if self.memory is not None:
            return
        memory = self._allocate()
        if memory.data_ptr() != self.ptr:
            del memory
            raise RuntimeError(
                "packgraph: the memory pool of a chained stack's hidden-state grad buffers gave back another address "
                f"({hex(self.ptr)} expected), so the captured backward graphs would write memory they do not own. "
                "Something allocated in that pool or released it. Do not route allocations into pools you did not "
                "create; capture the layers again (a new capture_layers call) to recover."
            )
        self.memory = memory


class ChainGradSlots:
    """The chained grad buffers of one capture group, as :class:`~packgraph.graphs.handouts.Handout` records.

    Args:
        cuda: the group records CUDA graphs (a stand-in recorder's slots stay allocated, see the module docstring).
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._records: dict[tuple, Handout] = {}
        self._blocks: dict[tuple, _Block] = {}
        self._lent = True

    def record(self, like: Tensor, position: int, slot: int) -> Handout:
        """The record of slot ``slot`` (0 or 1) of ``like``'s layout, for chained input ``position``."""
        layout = (tuple(like.shape), like.stride(), like.dtype, like.device, position)
        record = self._records.get((*layout, slot))
        if record is not None:
            return record
        self.lend()
        block = self._blocks.get(layout)
        if block is None and like.is_cuda and self.cuda and _lending_api():
            block = self._blocks[layout] = _Block(like)
        for k in (0, 1):
            if block is not None:
                buf = block.statics[k]
            else:
                buf = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device).zero_()
            name = "grad of the hidden states between chained layers"
            self._records[(*layout, k)] = Handout(buf, seq=0, owner=("chain", layout, k), pool=OUTSIDE_POOLS, name=name)
        return self._records[(*layout, slot)]

    def records(self) -> list[Handout]:
        return list(self._records.values())

    def lend(self) -> None:
        """Before a backward replay or capture: the slots' memory is allocated (cheap when it already is)."""
        if self._lent:
            return
        for block in self._blocks.values():
            block.lend()
        self._lent = True

    def give_back(self) -> None:
        """Before a forward: free the slots' memory unless a tensor handed out on it is still held (then it stays
        allocated, and the backward that next writes it moves that tensor first)."""
        if not self._lent or not self._records:
            return
        if any(r.held() for r in self._records.values()):
            return
        # A group's slots are all in lent blocks (CUDA with MemPool) or all tensors of their own (see record()).
        for block in self._blocks.values():
            block.memory = None
        if not self._blocks:
            with torch.no_grad():
                for r in self._records.values():
                    if r.static.is_floating_point():
                        r.static.fill_(float("nan"))
        self._lent = False

    def close(self) -> None:
        """The group is going away, and with it the blocks: move every tensor still handed out on them to memory of
        its own, then free each block before its pool. A tensor that cannot be moved (without a storage swap)
        keeps the blocks and their pools for the process's lifetime instead of reading freed memory."""
        # A finalizer: the garbage collector may run it inside a dispatch mode (torch.compile's FakeTensorMode),
        # where the copies would be fake.
        with _disable_current_modes():
            kept = [r.settle_or_keep() for r in self._records.values()]
        if any(kept):
            KEPT_FOR_HOLDERS.extend(self._blocks.values())
            self._blocks = {}
            return
        for block in self._blocks.values():
            block.close()
        self._blocks = {}
