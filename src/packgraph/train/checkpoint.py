"""Training checkpoints: finding, writing, loading and checking them against the run that resumes.

A checkpoint holds only tensors, numbers, strings, ``None`` and lists, tuples and dicts of those, and is loaded
with ``torch.load(weights_only=True)``: loading one runs no code from the file. Its keys: ``model``,
``optimizer``, ``scheduler`` (state dicts), ``step`` (steps done), ``rng`` (:func:`rng_state`), ``data`` (the
stream's position), ``model_config`` and ``train_config`` (as dicts).

A checkpoint is written atomically (:func:`write_checkpoint`), and a resumed run checks every part of one against
the run's model, optimizer, schedule and data (:func:`check_checkpoint`) before it restores any of them: a damaged
file is refused with a ``ValueError`` naming the broken part, never half-loaded.
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
    "check_checkpoint",
    "check_model_state",
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
    if not isinstance(saved, dict):
        raise ValueError(f"checkpoint {cfg.resume}: train_config is a {type(saved).__name__}, not a dict")
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


def _names(keys: list[str], limit: int = 4) -> str:
    shown = ", ".join(str(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_model_state(state: Any, model: torch.nn.Module) -> None:
    """``ValueError`` unless ``state`` is a state dict that ``model.load_state_dict`` takes as a whole: the same
    keys (missing and unexpected ones named), each a tensor of the model's shape."""
    if not isinstance(state, dict):
        raise ValueError(f"model is a {type(state).__name__}, not a state dict")
    want = model.state_dict()
    missing = [k for k in want if k not in state]
    unexpected = [k for k in state if k not in want]
    if missing or unexpected:
        parts = [f"missing {_names(missing)}"] if missing else []
        parts += [f"unexpected {_names(unexpected)}"] if unexpected else []
        raise ValueError(f"model state does not fit the model: {'; '.join(parts)}")
    wrong = [
        f"{k} is {tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__}, not {tuple(want[k].shape)}"
        for k, v in state.items()
        if not isinstance(v, Tensor) or v.shape != want[k].shape
    ]
    if wrong:
        raise ValueError(f"model state does not fit the model: {_names(wrong, 2)}")


def _check_optimizer(state: Any, optimizer: torch.optim.Optimizer) -> None:
    if not (
        isinstance(state, dict) and isinstance(state.get("state"), dict) and isinstance(state.get("param_groups"), list)
    ):
        raise ValueError("optimizer is not an optimizer state dict (a dict with 'state' and 'param_groups')")
    groups, params = state["param_groups"], {}
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"optimizer has {len(groups)} parameter groups, the run's optimizer {len(optimizer.param_groups)}"
        )
    for i, (saved, now) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        if not (isinstance(saved, dict) and isinstance(saved.get("params"), list)) or not all(
            _is_int(p) for p in saved["params"]
        ):
            raise ValueError(f"optimizer parameter group {i} is not a dict with a 'params' list of parameter ids")
        if len(saved["params"]) != len(now["params"]):
            raise ValueError(
                f"optimizer parameter group {i} holds {len(saved['params'])} parameters, the run's {len(now['params'])}"
            )
        if not isinstance(saved.get("lr"), (int, float)) or isinstance(saved.get("lr"), bool):
            raise ValueError(f"optimizer parameter group {i} has no numeric 'lr'")
        params.update(zip(saved["params"], now["params"], strict=True))
    for key, per_param in state["state"].items():
        if key not in params:
            raise ValueError(f"optimizer state names parameter {key!r}, which no parameter group holds")
        if not isinstance(per_param, dict):
            raise ValueError(f"optimizer state of parameter {key!r} is a {type(per_param).__name__}, not a dict")
        shape = params[key].shape
        for name, value in per_param.items():
            # per-parameter buffers (Adam's moments) have the parameter's shape; counters like 'step' are scalars
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape != shape:
                raise ValueError(
                    f"optimizer state {name!r} of parameter {key!r} is {tuple(value.shape)}, not {tuple(shape)}"
                )


def _check_scheduler(state: Any, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"scheduler is a {type(state).__name__}, not a state dict")
    groups = len(scheduler.optimizer.param_groups)
    if not _is_int(state.get("last_epoch")) or state["last_epoch"] < 0:
        raise ValueError(f"scheduler's last_epoch is {state.get('last_epoch')!r}, not a step count (an int >= 0)")
    base_lrs = state.get("base_lrs")
    if not isinstance(base_lrs, list) or len(base_lrs) != groups:
        raise ValueError(f"scheduler's base_lrs is {base_lrs!r}, not a list of {groups} learning rates")
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):  # its load_state_dict reads one entry per group
        lambdas = state.get("lr_lambdas")
        if (
            not isinstance(lambdas, list)
            or len(lambdas) != groups
            or any(f is not None and not isinstance(f, dict) for f in lambdas)
        ):
            raise ValueError(f"scheduler's lr_lambdas is {lambdas!r}, not a list of {groups} entries")


def _check_data(state: Any, data: DataStream) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"data is a {type(state).__name__}, not the data stream's position (epoch, position)")
    want = data.state_dict()
    missing = [k for k in want if k not in state]
    if missing:
        raise ValueError(f"data is missing {_names(missing)} (the data stream's position needs {_names(list(want))})")
    bad = [k for k in want if not _is_int(state[k]) or state[k] < 0]
    if bad:
        raise ValueError("data " + ", ".join(f"{k} is {state[k]!r}" for k in bad) + ", not an int >= 0")
    if state["position"] > data.bins_per_epoch:
        raise ValueError(f"data position {state['position']} is past the epoch's {data.bins_per_epoch} batches")


def _check_rng(state: Any, device: torch.device) -> None:
    if not isinstance(state, dict) or "torch" not in state or "python" not in state:
        raise ValueError("rng is not an RNG state (a dict with 'torch' and 'python')")
    # Each state is tried on a throwaway generator, so a bad one is refused before the process's RNGs change.
    try:
        torch.Generator().set_state(state["torch"])
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"rng['torch'] is not a CPU generator state ({str(e).splitlines()[0]})") from None
    python, want = state["python"], random.getstate()
    try:
        version, internal, gauss = python
        # setstate takes more than getstate gives (other versions, any gauss), which would fail later, in a draw
        if version != want[0] or len(internal) != len(want[1]) or not isinstance(gauss, (float, type(None))):
            raise ValueError(f"expected [{want[0]}, {len(want[1])} ints, a float or None]")
        random.Random().setstate((version, tuple(internal), gauss))
    except (TypeError, ValueError) as e:
        raise ValueError(f"rng['python'] is not a Python random state ({e})") from None
    cuda = state.get("cuda")
    if device.type == "cuda" and cuda is not None:
        if not isinstance(cuda, (list, tuple)) or not all(
            isinstance(t, Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in cuda
        ):
            raise ValueError("rng['cuda'] is not a list of CUDA generator states (1-D uint8 tensors)")


def check_checkpoint(
    ckpt: dict[str, Any],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    data: DataStream,
    device: torch.device,
    model_config: GPTConfig,
    train_config: TrainConfig,
) -> None:
    """``ValueError`` naming the first part of ``ckpt`` that :func:`restore_training_state` could not restore into
    these parts whole: another model, a model state of other keys or shapes, optimizer or schedule states of
    another structure, a data position without its keys, an RNG state a generator refuses, or a ``step`` that is
    not an int in ``[0, train_config.steps)``. Reads the parts; changes nothing."""
    source = f"checkpoint {resolve_checkpoint(train_config.resume) if train_config.resume else ''}".rstrip()
    if ckpt["model_config"] != dataclasses.asdict(model_config):
        raise ValueError(f"{source} holds a different model: {ckpt['model_config']}")
    step = ckpt["step"]
    if not _is_int(step) or step < 0:
        raise ValueError(f"{source}: step is {step!r}, not a count of steps done (an int >= 0)")
    if step >= train_config.steps:
        raise ValueError(f"{source} is at step {step}; ask for more steps than that (got --steps {train_config.steps})")
    try:
        check_model_state(ckpt["model"], model)
        _check_optimizer(ckpt["optimizer"], optimizer)
        _check_scheduler(ckpt["scheduler"], scheduler)
        _check_data(ckpt["data"], data)
        _check_rng(ckpt["rng"], device)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


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

    Every part is checked first (:func:`check_checkpoint`), so a damaged checkpoint changes nothing.

    Raises:
        ValueError: ``ckpt`` holds another model, a part that does not fit the run (named), or a ``step`` that is
            negative, not an int, or ``train_config.steps`` or more.
    """
    parts = dict(model=model, optimizer=optimizer, scheduler=scheduler, data=data, device=device)
    check_checkpoint(ckpt, **parts, model_config=model_config, train_config=train_config)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    data.load_state_dict(ckpt["data"])
    set_rng_state(ckpt["rng"], device)
    return ckpt["step"]


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
        # A run saved on a machine with more GPUs holds states for devices this one does not have.
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])
