"""Process bootstrap: launch ``packgraph train`` through torchrun, and join the process group inside it.

``launch(nproc, argv)`` re-executes ``python -m packgraph.cli train <argv>`` under ``torch.distributed.run``
(torchrun) with ``nproc`` processes on this host. Each child reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` through
:func:`init_distributed`, which initialises the default process group: NCCL when CUDA is available (one GPU
per local rank), gloo otherwise. :func:`parallel_groups` splits the world into data- and context-parallel
groups.

``NCCL_NVLS_ENABLE=0`` is set for the children (and defaulted by :func:`init_distributed`): NVLink SHARP
multicast needs fabric support that shared machines do not grant, and NCCL would fail at communicator init.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DistributedContext",
    "ParallelGroups",
    "init_distributed",
    "launch",
    "parallel_groups",
    "shutdown_distributed",
    "torchrun_command",
]

CHILD_ENV: dict[str, str] = {"NCCL_NVLS_ENABLE": "0"}
"""Environment every launched process gets."""


def torchrun_command(
    nproc: int, argv: Sequence[str], *, module: str = "packgraph.cli", subcommand: str | None = "train"
) -> list[str]:
    """The torchrun command line :func:`launch` runs: ``python -m torch.distributed.run --standalone
    --nproc_per_node N -m <module> [subcommand] <argv>``.

    ``--nproc``/``--nproc=N`` options in ``argv`` are dropped (the children must not launch again); a leading
    ``subcommand`` in ``argv`` is not repeated. ``--standalone`` picks a free rendezvous port on this host.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    args = list(argv)
    if subcommand is not None and args[:1] == [subcommand]:
        args = args[1:]
    cleaned: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            cleaned.append(a)
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module]
    return head + ([subcommand] if subcommand is not None else []) + cleaned


def launch(
    nproc: int,
    argv: Sequence[str],
    *,
    module: str = "packgraph.cli",
    subcommand: str | None = "train",
    env: dict[str, str] | None = None,
) -> int:
    """Run ``python -m <module> <subcommand> <argv>`` in ``nproc`` processes through torchrun; return its exit code.

    Blocks until every process exits. ``NCCL_NVLS_ENABLE=0`` (and ``env``) are added to this process's
    environment for the children. torchrun itself handles signals and tears the group down on failure.
    """
    child_env = {**os.environ, **CHILD_ENV, **(env or {})}
    return subprocess.run(torchrun_command(nproc, argv, module=module, subcommand=subcommand), env=child_env).returncode


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits. ``world_size == 1`` and ``initialized == False`` outside torchrun."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    initialized: bool


def init_distributed(
    backend: str | None = None, *, timeout: timedelta | None = None, device: str | None = None
) -> DistributedContext:
    """Join the default process group from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``); a no-op context when ``WORLD_SIZE`` is unset.

    Backend: ``nccl`` when CUDA is available (and ``torch.cuda.set_device(LOCAL_RANK)`` first), else ``gloo``.
    Idempotent: an already-initialised group is described, not re-created.

    Args:
        backend: force a backend (e.g. ``"gloo"`` for CPU tensors on a CUDA machine).
        timeout: collective timeout (torch's default otherwise).
        device: force ``"cpu"`` or ``"cuda"`` instead of the automatic choice.
    """
    use_cuda = torch.cuda.is_available() if device is None else device == "cuda"
    if dist.is_available() and dist.is_initialized():
        return _describe(use_cuda)
    if "WORLD_SIZE" not in os.environ:
        dev = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        return DistributedContext(0, 1, 0, dev, None, False)
    for key, value in CHILD_ENV.items():
        os.environ.setdefault(key, value)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    backend = backend or ("nccl" if use_cuda else "gloo")
    kwargs: dict[str, Any] = {"backend": backend, "init_method": "env://"}
    if timeout is not None:
        kwargs["timeout"] = timeout
    dist.init_process_group(**kwargs)
    return _describe(use_cuda)


def _describe(use_cuda: bool) -> DistributedContext:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    return DistributedContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=dev,
        backend=dist.get_backend(),
        initialized=True,
    )


def shutdown_distributed() -> None:
    """Destroy the default process group if one exists (call at the end of training)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class ParallelGroups:
    """Data- and context-parallel groups of one rank. Ranks are laid out ``rank = dp_rank * cp_size + cp_rank``,
    so a CP group is consecutive ranks (same host, fastest links: CP communicates every layer).

    ``dp_group`` holds the ranks with the same ``cp_rank`` (one per batch); ``dp_cp_group`` is the whole world,
    the group to reduce gradients over when both are in use.
    """

    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    dp_group: Any
    cp_group: Any
    dp_cp_group: Any


def parallel_groups(cp_size: int = 1) -> ParallelGroups:
    """Split the initialised world into DP x CP groups (module docstring). Every rank must call it, in the same
    order relative to other group creations (``new_group`` is collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if cp_size < 1 or world % cp_size:
        raise ValueError(f"cp_size={cp_size} must divide the world size {world}")
    dp_size = world // cp_size
    cp_group = dp_group = None
    for d in range(dp_size):
        g = dist.new_group(list(range(d * cp_size, (d + 1) * cp_size)))
        if rank // cp_size == d:
            cp_group = g
    for c in range(cp_size):
        g = dist.new_group(list(range(c, world, cp_size)))
        if rank % cp_size == c:
            dp_group = g
    return ParallelGroups(
        dp_rank=rank // cp_size,
        dp_size=dp_size,
        cp_rank=rank % cp_size,
        cp_size=cp_size,
        dp_group=dp_group,
        cp_group=cp_group,
        dp_cp_group=dist.group.WORLD,
    )
