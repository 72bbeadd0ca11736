"""Data parallel training under ``torchrun``, through :mod:`packgraph.distributed` (imported only when used)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

__all__ = ["DataParallelGroup"]


class DataParallelGroup:
    """This process's share of a ``torchrun`` job (``WORLD_SIZE > 1``).

    Gradients are summed across ranks after backward (each rank's losses are already weighted by the global
    target count), which equals single-process training on the union of the ranks' micro-batches.
    """

    def __init__(self, ctx: Any, owns_group: bool) -> None:
        self.ctx, self.owns_group = ctx, owns_group
        self.rank, self.world, self.device = ctx.rank, ctx.world_size, ctx.device

    @classmethod
    def from_env(cls, device: torch.device) -> DataParallelGroup | None:
        """The group of this ``torchrun`` job (joined if not yet), or ``None`` in a single process."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        import torch.distributed as dist

        from packgraph.distributed import init_distributed

        owns = not (dist.is_available() and dist.is_initialized())
        return cls(init_distributed(device=device.type), owns)

    def broadcast(self, model: torch.nn.Module) -> None:
        from packgraph.distributed import broadcast_parameters

        broadcast_parameters(model)

    def reduce(self, model: torch.nn.Module, step_loss: Tensor) -> Tensor:
        """Sum the gradients and ``step_loss`` over the ranks (in place); ``step_loss``."""
        import torch.distributed as dist

        from packgraph.distributed import allreduce_gradients

        # Every rank runs the whole GPT on at least one micro-batch: every trained parameter has a grad, so the
        # all-reduce needs no per-parameter flags (and their device-to-host read).
        allreduce_gradients(model.parameters(), every_rank_has_grads=True)
        dist.all_reduce(step_loss)
        return step_loss

    def close(self) -> None:
        """Shut the process group down if this group joined it."""
        if self.owns_group:
            from packgraph.distributed import shutdown_distributed

            shutdown_distributed()
