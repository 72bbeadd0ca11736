"""Data parallel training under ``torchrun``, through :mod:`packgraph.distributed` (imported only when used)."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from packgraph.train.config import DP_ENGINES

__all__ = ["DataParallelGroup"]


class DataParallelGroup:
    """This process's share of a ``torchrun`` job (``WORLD_SIZE > 1``).

    Each rank's losses are weighted by the global target count, so summing the gradients over the ranks equals
    single-process training on the union of the ranks' micro-batches. ``engine`` picks who sums them: ``"ddp"``,
    torch's ``DistributedDataParallel`` with a summing all-reduce (buckets reduced while the backward runs), or
    ``"allreduce"``, packgraph's explicit all-reduce after the step's last backward (kept to compare).
    """

    def __init__(self, ctx: Any, owns_group: bool, engine: str = "ddp") -> None:
        if engine not in DP_ENGINES:
            raise ValueError(f"dp engine must be one of {DP_ENGINES}, got {engine!r}")
        self.ctx, self.owns_group, self.engine = ctx, owns_group, engine
        self.rank, self.world, self.device = ctx.rank, ctx.world_size, ctx.device
        self._ddp: torch.nn.Module | None = None

    @classmethod
    def from_env(cls, device: torch.device, engine: str = "ddp") -> DataParallelGroup | None:
        """The group of this ``torchrun`` job (joined if not yet), or ``None`` in a single process."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        import torch.distributed as dist

        from packgraph.distributed import init_distributed

        owns = not (dist.is_available() and dist.is_initialized())
        return cls(init_distributed(device=device.type), owns, engine)

    def broadcast(self, model: torch.nn.Module) -> None:
        from packgraph.distributed import broadcast_parameters

        broadcast_parameters(model)

    def wrap(self, runner: torch.nn.Module) -> torch.nn.Module:
        """What the step calls: ``runner`` (the model or its graphed wrapper) inside DDP, or as is."""
        if self.engine != "ddp":
            return runner
        from packgraph.distributed import summing_ddp

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self._ddp = summing_ddp(runner, device_ids=device_ids)  # syncs the parameters from rank 0 here
        return self._ddp

    @property
    def no_sync(self) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
        """DDP's ``no_sync`` for the step's micro-batches but the last, or ``None``."""
        return self._ddp.no_sync if self._ddp is not None else None

    def reduce(self, model: torch.nn.Module, step_loss: Tensor) -> Tensor:
        """Sum ``step_loss`` (and, with the ``"allreduce"`` engine, the gradients) over the ranks, in place."""
        import torch.distributed as dist

        if self.engine == "allreduce":
            from packgraph.distributed import allreduce_gradients

            # Every rank runs the whole GPT on at least one micro-batch: every trained parameter has a grad, so
            # the all-reduce needs no per-parameter flags (and their device-to-host read).
            allreduce_gradients(model.parameters(), every_rank_has_grads=True)
        dist.all_reduce(step_loss)
        return step_loss

    def close(self) -> None:
        """Drop DDP, then shut the process group down if this group joined it."""
        # The reducer goes before the group: a gloo group destroyed by the reducer's destructor joins its worker
        # thread holding the GIL, which that thread may need.
        if self._ddp is not None:
            self._ddp = None
            gc.collect()  # DDP and its reducer, if a reference cycle holds them
        if self.owns_group:
            from packgraph.distributed import shutdown_distributed

            shutdown_distributed()
