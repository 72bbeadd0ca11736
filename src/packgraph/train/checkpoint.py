"""Training checkpoints: finding, writing, loading and checking them against the run that resumes.

A checkpoint holds only tensors, numbers, strings, ``None`` and lists, tuples and dicts of those, and is loaded
with ``torch.load(weights_only=True)``: loading one runs no code from the file. Its keys: ``model``,
``optimizer``, ``scheduler`` (state dicts), ``step`` (steps done), ``rng`` (:func:`rng_state`), ``data`` (the
stream's position), ``model_config`` and ``train_config`` (as dicts).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from packgraph.data.stream import DataStream
from packgraph.models.gpt import GPTConfig
from packgraph.train.config import TrainConfig
from packgraph.train.logs import atomic_open

__all__ = [
    "resolve_checkpoint",
    "load_checkpoint",
    "check_resumable",
    "training_state",
    "restore_training_state",
    "write_checkpoint",
    "rng_state",
    "set_rng_state",
]

_CHECKPOINT_KEYS = ("model_config", "model", "optimizer", "scheduler", "data", "step", "rng")
# What decides the data order and the batches: resuming with any of these changed would continue another run.
_RESUME_MUST_MATCH = (
    "seed", "T", "grad_accum", "max_docs", "chunk_len", "min_chunk_len", "pad_to_multiple", "algorithm",
    "max_seqlen_ladder", "capacity_ladder",
)  # fmt: skip
_PLAIN = (Tensor, int, float, str, bool, type(None))


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint file ``path`` names: the file itself, or ``checkpoint.pt`` in a run dir.

    Raises:
        FileNotFoundError: no such file.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "checkpoint.pt"
    if not p.is_file():
        raise FileNotFoundError(f"no checkpoint at {path} (pass a checkpoint file or a run directory holding one)")
    return p


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A training checkpoint (a file, or a run dir holding ``checkpoint.pt``), loaded on the CPU as data only.

    The file is read with ``torch.load(weights_only=True)``: tensors, numbers, strings and containers of them. A
    file that needs anything else (a pickled class or function, which unpickling would run) is refused.

    Raises:
        FileNotFoundError: nothing there.
        ValueError: unreadable, holding more than data (names the first such object), or not a packgraph
            training checkpoint (names the missing keys).
    """
    file = resolve_checkpoint(path)
    try:
        ckpt = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if found is None:
            raise ValueError(f"cannot read checkpoint {file}: it is corrupt or not a packgraph checkpoint") from None
        raise ValueError(
            f"refusing to load {file}: it holds a pickled Python object ({found.group(1)}), and unpickling it could "
            "run any code. packgraph checkpoints hold only tensors and plain data. If you trust the file's source, "
            "load it yourself with torch.load(..., weights_only=False) and save its tensors and plain values again"
        ) from None
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"cannot read checkpoint {file}: {type(e).__name__}: {e}") from None
    missing = [k for k in _CHECKPOINT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ValueError(f"{file} is not a packgraph training checkpoint (missing: {', '.join(missing)})")
    return ckpt


def check_resumable(ckpt: dict[str, Any], cfg: TrainConfig) -> None:
    """``ValueError`` naming each setting that decides the data order and differs between ``ckpt``'s run and
    ``cfg``."""
    saved = ckpt.get("train_config") or {}
    now = dataclasses.asdict(cfg)

    def norm(v: Any) -> Any:
        return list(v) if isinstance(v, (list, tuple)) else v

    changed = [
        f"{k}: checkpoint {saved[k]!r}, now {now[k]!r}"
        for k in _RESUME_MUST_MATCH
        if k in saved and norm(saved[k]) != norm(now[k])
    ]
    if changed:
        raise ValueError(
            "cannot resume: these settings decide the data order and differ from the checkpoint's run ("
            + "; ".join(changed)
            + "). Resume with the same values, or start a new run."
        )


def training_state(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    data: DataStream,
    step: int,
    device: torch.device,
    model_config: GPTConfig,
    train_config: TrainConfig,
) -> dict[str, Any]:
    """A run's state after ``step`` steps, as a checkpoint holds it (see the module docstring)."""
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "step": step,
        "rng": rng_state(device),
        "data": data.state_dict(),
        "model_config": dataclasses.asdict(model_config),
        # through JSON: a Path or another object in the config is saved as the string config.json shows
        "train_config": json.loads(json.dumps(dataclasses.asdict(train_config), default=str)),
    }


def restore_training_state(
    ckpt: dict[str, Any],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    data: DataStream,
    device: torch.device,
    model_config: GPTConfig,
    train_config: TrainConfig,
) -> int:
    """Load ``ckpt`` (from :func:`load_checkpoint`) into the run's parts and RNGs; the number of steps it holds.

    Raises:
        ValueError: ``ckpt`` holds another model, or as many steps as ``train_config.steps`` or more.
    """
    if ckpt["model_config"] != dataclasses.asdict(model_config):
        raise ValueError(f"checkpoint {train_config.resume} holds a different model: {ckpt['model_config']}")
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    data.load_state_dict(ckpt["data"])
    start = int(ckpt["step"])
    if start >= train_config.steps:
        raise ValueError(
            f"checkpoint is at step {start}; ask for more steps than that (got --steps {train_config.steps})"
        )
    set_rng_state(ckpt["rng"], device)
    return start


def _check_plain(obj: Any, where: str = "checkpoint") -> None:
    """``TypeError`` naming the first value that ``torch.load(weights_only=True)`` would refuse."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            _check_plain(k, f"{where} key")
            _check_plain(v, f"{where}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
    elif not isinstance(obj, _PLAIN):
        raise TypeError(f"{where} is a {type(obj).__name__}: checkpoints hold only tensors and plain data")


def write_checkpoint(state: dict[str, Any], path: Path) -> None:
    """Save ``state`` at ``path`` atomically (:func:`~packgraph.train.logs.atomic_open`); ``TypeError`` first if it
    holds more than tensors and plain data."""
    _check_plain(state)
    # Through <name>.tmp, fsynced, then renamed: a crash or a failed save leaves the previous checkpoint whole.
    with atomic_open(path) as f:
        torch.save(state, f)


def rng_state(device: torch.device) -> dict[str, Any]:
    """The RNG states as tensors and plain lists (what ``weights_only`` loading accepts)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if device.type == "cuda":
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` saved (the CUDA states only on a CUDA device)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
