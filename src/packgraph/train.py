"""Train the reference GPT on the embedded corpus, eagerly or with CUDA graphs.

One step: ``grad_accum`` micro-batches of ``T`` rows each, forward + backward (bf16 autocast on CUDA), gradient
clipping, fused AdamW, then the learning-rate schedule (linear warm-up, cosine decay to
``min_lr_ratio * lr``). Micro-batch losses are weighted by their share of the step's real target tokens, so the
step's gradient is that of the mean CE over every target token of the step (see :mod:`packgraph.models.gpt`).

Data order is deterministic (:mod:`packgraph.data.stream`): corpus pieces of seeded random length, packed once,
each epoch visiting the bins in an order shuffled by ``(seed, epoch)``. The data position is ``(epoch, bin
index)``, so a checkpoint resumes on the very next batch. Log reading, smoothing and plots live in
:mod:`packgraph.runlog`.

Host syncs: a step leaves its loss and gradient norm on the device. A *logged* step (the run's first, every
``log_every``-th, the last, and each checkpoint step) reads the values of every step since the last logged one in
one device-to-host transfer; the other steps never wait for the device (on CUDA, batches go up from pinned memory
without blocking, and step times come from CUDA events). :class:`Trainer` runs a config one step at a time,
:func:`train` runs it to the end.

Artefacts, under ``out_dir``: ``config.json``, ``train.jsonl`` (one row per step, written at logged steps),
``checkpoint.pt`` (latest; ``checkpoint-<step>.pt`` every ``checkpoint_every`` steps), ``summary.json`` and
``loss.png`` (needs matplotlib). Checkpoints hold only tensors, numbers, strings, ``None`` and lists, tuples and
dicts of those, and are loaded with ``torch.load(weights_only=True)``: loading one runs no code from the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pickle
import random
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from packgraph.buckets import BucketPolicy, default_buckets
from packgraph.data.corpus import VOCAB_SIZE
from packgraph.data.stream import DataStream, corpus_documents
from packgraph.graphs.recorder import stand_in
from packgraph.models.gpt import GPT, SCOPES, GPTConfig
from packgraph.packing import PACKING_ALGORITHMS, PackedBatch
from packgraph.runlog import plot_losses, throughput

__all__ = [
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "train",
    "load_checkpoint",
    "deterministic_kernels",
    "accumulate_gradients",
    "compare_eager_graphed",
    "lr_factor",
    "resolve_device",
    # Re-exported from packgraph.data.stream for tests/cuda/test_gpt_cuda.py, which imports them from here.
    "DataStream",
    "corpus_documents",
]


@dataclass
class TrainConfig:
    """Everything a run depends on. ``validate()`` rejects bad values with a ``ValueError`` that says what to do.

    ``T`` is the rows per micro-batch (static: every batch has exactly ``T`` rows). ``graphs=None`` means "on
    when the device is CUDA". Bucket ladders default to :func:`~packgraph.buckets.default_buckets` of ``T``.
    ``log_every`` is how often the loop reads its values from the device (see the module docstring); every step
    is still logged, with its own loss.
    """

    preset: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    steps: int = 100
    T: int = 2048
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "auto"
    autocast: bool = True
    graphs: bool | None = False
    scope: str = "layer"
    max_seqlen_ladder: tuple[int, ...] | None = None
    capacity_ladder: tuple[int, ...] | None = None
    max_docs: int | None = None
    chunk_len: int | None = None
    min_chunk_len: int | None = 64
    pad_to_multiple: int = 1
    algorithm: str = "ffd"
    out_dir: str | None = None
    resume: str | None = None
    checkpoint_every: int = 0
    save_checkpoint: bool = True
    progress: bool = True
    plot: bool = True
    deterministic: bool = False
    log_every: int = 1

    def validate(self) -> TrainConfig:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        GPTConfig.preset(self.preset, vocab_size=VOCAB_SIZE, **self.model_overrides)  # raises on a bad preset
        need(self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        need(self.T >= 2, f"T (rows per micro-batch) must be >= 2, got {self.T}")
        need(self.grad_accum >= 1, f"grad_accum must be >= 1, got {self.grad_accum}")
        need(self.lr > 0 and 0 <= self.min_lr_ratio <= 1, "lr must be > 0 and min_lr_ratio in [0, 1]")
        need(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        need(self.grad_clip >= 0, f"grad_clip must be >= 0 (0 disables), got {self.grad_clip}")
        need(self.scope in SCOPES, f"scope must be one of {SCOPES}, got {self.scope!r}")
        need(self.max_docs is None or self.max_docs >= 1, f"max_docs must be >= 1, got {self.max_docs}")
        need(self.chunk_len is None or self.chunk_len >= 2, f"chunk_len must be >= 2, got {self.chunk_len}")
        need(
            self.min_chunk_len is None or self.min_chunk_len >= 2,
            f"min_chunk_len must be >= 2, got {self.min_chunk_len}",
        )
        need(self.pad_to_multiple >= 1, f"pad_to_multiple must be >= 1, got {self.pad_to_multiple}")
        need(self.algorithm in PACKING_ALGORITHMS, f"algorithm must be one of {PACKING_ALGORITHMS}")
        need(self.checkpoint_every >= 0, f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        need(self.log_every >= 1, f"log_every must be >= 1, got {self.log_every}")
        self.bucket_policy()  # raises on bad ladders
        return self

    def bucket_policy(self) -> BucketPolicy:
        """The policy batches are bucketed with (``ValueError`` on bad ladders)."""
        default = default_buckets(self.T)
        policy = BucketPolicy(
            tuple(self.max_seqlen_ladder or default.max_seqlen_ladder),
            tuple(self.capacity_ladder or default.capacity_ladder),
        )
        if policy.max_seqlen > self.T:
            raise ValueError(f"max_seqlen ladder {policy.max_seqlen_ladder} has rungs above T={self.T}")
        return policy

    def model_config(self) -> GPTConfig:
        return GPTConfig.preset(self.preset, vocab_size=VOCAB_SIZE, **self.model_overrides)


@dataclass
class TrainResult:
    """What a run did. ``losses[i]`` is the loss of step ``first_step + i + 1`` (1-based steps in logs).

    ``tokens_per_s`` is the steady rate and ``tokens_per_s_overall`` the rate over every step (see
    :func:`~packgraph.runlog.throughput`); tokens are real document tokens, not padded slots. Step times are CUDA
    events on CUDA (from the step's first kernel to its optimizer update, data loading left out) and wall clock on
    the CPU. ``first_step_s`` is the wall time of the run's first step until its loss is on the host: captures,
    lazy initialisation and all.
    """

    out_dir: Path
    first_step: int
    losses: list[float]
    tokens_per_s: float
    tokens_per_s_overall: float
    step_ms_median: float
    tokens: int
    device: str
    graphs: bool
    scope: str | None
    num_graph_sets: int
    recaptures: int
    log_path: Path
    checkpoint_path: Path | None
    plot_path: Path | None
    wall_s: float
    first_step_s: float

    @property
    def final_loss(self) -> float:
        return self.losses[-1]


# ---------------------------------------------------------------------------------------------- helpers
def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> cuda when available, else cpu. ``ValueError`` for CUDA without CUDA or an unknown name."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"unknown device {name!r} (use auto, cpu, cuda or cuda:N)") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available here; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r} (use cpu or cuda)")
    return device


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at 0-based ``step``: linear warm-up to 1 over ``warmup`` steps, then cosine to
    ``min_ratio`` at ``total - 1``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class _DataParallel:
    """This process's share of a ``torchrun`` job (``WORLD_SIZE > 1``), through :mod:`packgraph.distributed`.

    Gradients are summed across ranks after backward (each rank's losses are already weighted by the global
    target count), which equals single-process training on the union of the ranks' micro-batches.
    """

    def __init__(self, ctx: Any, owns_group: bool) -> None:
        self.ctx, self.owns_group = ctx, owns_group
        self.rank, self.world, self.device = ctx.rank, ctx.world_size, ctx.device

    @classmethod
    def from_env(cls, device: torch.device) -> _DataParallel | None:
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
        import torch.distributed as dist

        from packgraph.distributed import allreduce_gradients

        # Every rank runs the whole GPT on at least one micro-batch: every trained parameter has a grad, so the
        # all-reduce needs no per-parameter flags (and their device-to-host read).
        allreduce_gradients(model.parameters(), every_rank_has_grads=True)
        dist.all_reduce(step_loss)
        return step_loss

    def close(self) -> None:
        if self.owns_group:
            from packgraph.distributed import shutdown_distributed

            shutdown_distributed()


def _autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    if device.type != "cuda" or not enabled:
        return contextlib.nullcontext()
    # cache_enabled=False: cast weights cached across a graph capture would be freed when autocast exits while
    # the graph still reads them (the rule torch.cuda.make_graphed_callables documents).
    return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)


def _make_optimizer(model: GPT, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # fused on both devices (torch >= 2.4 has the kernel for CPU and CUDA): its step counters live beside the
    # parameters and it reads none of them on the host, so the optimizer adds no sync to a step.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), fused=True)


def _rng_state(device: torch.device) -> dict[str, Any]:
    """The RNG states as tensors and plain lists (what ``weights_only`` loading accepts)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if device.type == "cuda":
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _resolve_checkpoint(path: str | os.PathLike) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "checkpoint.pt"
    if not p.is_file():
        raise FileNotFoundError(f"no checkpoint at {path} (pass a checkpoint file or a run directory holding one)")
    return p


_CHECKPOINT_KEYS = ("model_config", "model", "optimizer", "scheduler", "data", "step", "rng")
# What decides the data order and the batches: resuming with any of these changed would continue another run.
_RESUME_MUST_MATCH = (
    "seed", "T", "grad_accum", "max_docs", "chunk_len", "min_chunk_len", "pad_to_multiple", "algorithm",
    "max_seqlen_ladder", "capacity_ladder",
)  # fmt: skip


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A training checkpoint (a file, or a run dir holding ``checkpoint.pt``), loaded on the CPU as data only.

    The file is read with ``torch.load(weights_only=True)``: tensors, numbers, strings and containers of them. A
    file that needs anything else (a pickled class or function, which unpickling would run) is refused.

    Raises:
        FileNotFoundError: nothing there.
        ValueError: unreadable, holding more than data (names the first such object), or not a packgraph
            training checkpoint (names the missing keys).
    """
    file = _resolve_checkpoint(path)
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


def _check_resumable(ckpt: dict[str, Any], cfg: TrainConfig) -> None:
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


def _truncate_log(path: Path, last_step: int) -> None:
    """Drop logged steps after ``last_step``, so a resumed run does not log them twice."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in keep))


def default_out_dir(command: str) -> Path:
    """``./runs/<command>-<timestamp>``, made unique with a suffix when it already exists."""
    base = Path("runs") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = base, 1
    while out.exists():
        out, n = base.with_name(f"{base.name}-{n}"), n + 1
    return out


_PLAIN = (Tensor, int, float, str, bool, type(None))


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


def _save(obj: dict[str, Any], path: Path) -> None:
    _check_plain(obj)
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # atomic: a crash never leaves a half-written checkpoint


def _progress(total: int, initial: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------- train
def accumulate_gradients(
    model: torch.nn.Module,
    micro_batches: Sequence[PackedBatch],
    device: torch.device,
    *,
    autocast: bool = True,
    total_targets: int | None = None,
) -> Tensor:
    """Forward and backward every micro-batch, accumulating into ``.grad``; return the step's loss (detached).

    Micro-batch ``i``'s mean loss is weighted by ``n_i / N`` (``n_i`` = its real target tokens, a host int; ``N``
    = ``total_targets``, default ``sum(n_i)``), so the accumulated gradient and the returned loss are those of the
    mean CE over all the step's targets: one big batch. Under data parallelism ``N`` is the count over every
    rank's micro-batches and the ranks' results sum to the global mean. ``model`` is a :class:`GPT` or a graphed
    wrapper; each micro-batch finishes its backward before the next forward (graph buffers are reused).
    """
    targets = [b.num_real_tokens for b in micro_batches]
    total = max(sum(targets) if total_targets is None else total_targets, 1)
    step_loss = torch.zeros((), device=device)
    for batch, n in zip(micro_batches, targets, strict=True):
        batch = batch.to(device)
        with _autocast(device, autocast):
            _, loss = model(batch)
        weight = n / total
        (loss * weight).backward()
        step_loss = step_loss + loss.detach().float() * weight
    return step_loss


@contextlib.contextmanager
def deterministic_kernels(enabled: bool) -> Iterator[None]:
    """Within the block, kernels are bitwise reproducible (``torch.use_deterministic_algorithms(True)``).

    This matters on CUDA: FlashAttention's backward then accumulates ``dq`` without atomics, and cuBLAS gets a fixed
    workspace (``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless set; read when a cuBLAS handle is created, so set it
    before the process's first matmul for a guarantee). An op with no deterministic kernel raises. The previous
    mode is restored on exit.
    """
    if not enabled:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def train(cfg: TrainConfig, *, echo: Callable[[str], None] | None = print) -> TrainResult:
    """Run ``cfg`` to its last step; see the module docstring for the step and the artefacts.

    With ``cfg.deterministic`` every kernel is deterministic (:func:`deterministic_kernels`): two runs of one
    config give the same losses bit for bit, and so do eager and graphed runs (the graphs replay the same kernels
    on the same data).

    Raises:
        ValueError: bad config (including graphs requested without CUDA).
        FileNotFoundError: ``resume`` names no checkpoint.
    """
    with deterministic_kernels(cfg.deterministic):
        trainer = Trainer(cfg, echo=echo)
        try:
            while not trainer.done:
                trainer.step()
            return trainer.finish()
        finally:
            trainer.close()


def _mark(device: torch.device) -> Any:
    """A point in time on ``device``'s stream: a recorded CUDA event, or ``perf_counter`` on the CPU."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _elapsed_ms(start: Any, end: Any) -> float:
    # Events are read only after the host has read a value computed after them, so both have completed.
    return start.elapsed_time(end) if isinstance(start, torch.cuda.Event) else (end - start) * 1e3


def _to_host(values: Tensor) -> list[list[float]]:
    """The loop's one device-to-host read per logged step."""
    return values.tolist()


@dataclass
class _PendingStep:
    """A finished step whose device values (loss, grad norm) are not read yet."""

    row: dict[str, Any]
    values: Tensor
    start: Any
    end: Any


class Trainer:
    """One training run of ``cfg``, an optimizer step at a time. :func:`train` is ``while not t.done: t.step()``,
    then ``t.finish()``; ``t.close()`` always.

    ``rows`` holds the logged rows so far (one per step, as in ``train.jsonl``); a step's row appears at the next
    logged step (:meth:`flush`). The caller enters :func:`deterministic_kernels` when ``cfg.deterministic`` (a
    step raises otherwise): a mode that spans several trainers cannot belong to any one of them.

    Args:
        documents: ``corpus_documents(cfg)`` (:func:`~packgraph.data.stream.corpus_documents`), when the caller
            has it already: several runs of one corpus read it once.

    Raises:
        ValueError: bad config, or a checkpoint that does not fit it. FileNotFoundError: no checkpoint at ``resume``.
    """

    def __init__(
        self, cfg: TrainConfig, *, echo: Callable[[str], None] | None = print, documents: Sequence[Tensor] | None = None
    ) -> None:
        cfg.validate()
        self.cfg = cfg
        device = resolve_device(cfg.device)
        self.graphs = device.type == "cuda" if cfg.graphs is None else cfg.graphs
        if self.graphs and device.type != "cuda" and stand_in() is None:  # (a stand-in recorder: CPU tests)
            raise ValueError("CUDA graphs need a CUDA device; run with --no-graphs (eager) or on a GPU")
        ckpt = load_checkpoint(cfg.resume) if cfg.resume else None
        if ckpt is not None:
            _check_resumable(ckpt, cfg)
        self.out_dir = Path(cfg.out_dir) if cfg.out_dir else default_out_dir("train")
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise ValueError(f"out dir {self.out_dir} exists and is not a directory")
        self.dp = _DataParallel.from_env(device)
        self.device = self.dp.device if self.dp is not None else device
        self.rank, self.world = (self.dp.rank, self.dp.world) if self.dp is not None else (0, 1)
        self._say = (echo if self.rank == 0 else None) or (lambda _msg: None)
        self._bar = None
        try:
            self._setup(ckpt, documents)
        except BaseException:
            self.close()  # the process group this trainer started
            raise

    def _setup(self, ckpt: dict[str, Any] | None, documents: Sequence[Tensor] | None) -> None:
        cfg = self.cfg
        if self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        self._build(documents)
        self.start = self._resume(ckpt) if ckpt is not None else 0
        self.step_index = self.start
        if self.dp is not None:
            self.dp.broadcast(self.model)
        self.log_path = self.out_dir / "train.jsonl"
        if self.rank == 0:
            (self.out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2, default=str) + "\n")
            if ckpt is not None:
                _truncate_log(self.log_path, self.start)
            else:
                self.log_path.write_text("")
        self.runner = self.model.graphed(scope=cfg.scope) if self.graphs else self.model
        self.mode = "graphed, scope " + cfg.scope if self.graphs else "eager"
        self._announce()
        self.rows: list[dict[str, Any]] = []
        self._pending: list[_PendingStep] = []
        self.first_step_s: float | None = None
        self._bar = _progress(cfg.steps, self.start, cfg.progress and self.rank == 0)
        self._t_run = time.perf_counter()
        self.model.train()

    def _build(self, documents: Sequence[Tensor] | None) -> None:
        """Model, optimizer, schedule and data stream, from the seed."""
        cfg = self.cfg
        # The model is built on the CPU from the seed, then moved: the same init on every device.
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        self.model_cfg = cfg.model_config()
        self.model = GPT(self.model_cfg).to(self.device)
        self.params = list(self.model.parameters())
        self.optimizer = _make_optimizer(self.model, cfg, self.device)
        warmup = min(cfg.warmup_steps, cfg.steps - 1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup=warmup, total=cfg.steps, min_ratio=cfg.min_lr_ratio)
        )
        self.docs = list(documents) if documents is not None else corpus_documents(cfg)
        self.data = DataStream(
            self.docs,
            T=cfg.T,
            policy=cfg.bucket_policy(),
            seed=cfg.seed,
            algorithm=cfg.algorithm,
            pad_to_multiple=cfg.pad_to_multiple,
        )

    def _resume(self, ckpt: dict[str, Any]) -> int:
        if ckpt["model_config"] != dataclasses.asdict(self.model_cfg):
            raise ValueError(f"checkpoint {self.cfg.resume} holds a different model: {ckpt['model_config']}")
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.data.load_state_dict(ckpt["data"])
        start = int(ckpt["step"])
        if start >= self.cfg.steps:
            raise ValueError(
                f"checkpoint is at step {start}; ask for more steps than that (got --steps {self.cfg.steps})"
            )
        _set_rng_state(ckpt["rng"], self.device)
        return start

    def _announce(self) -> None:
        cfg = self.cfg
        ranks = f" x {self.world} ranks" if self.world > 1 else ""
        self._say(
            f"train: {cfg.preset} ({self.model_cfg.num_params() / 1e6:.2f}M params) on {self.device}, {self.mode}; "
            f"steps {self.start + 1}..{cfg.steps}, T={cfg.T} x {cfg.grad_accum}{ranks}, {len(self.docs)} docs in "
            f"{self.data.bins_per_epoch} bins/epoch (efficiency {self.data.packing.efficiency:.3f}); "
            f"out dir {self.out_dir}"
        )

    @property
    def done(self) -> bool:
        return self.step_index >= self.cfg.steps

    def _is_logged(self, done: int) -> bool:
        cfg = self.cfg
        return done == self.start + 1 or done % cfg.log_every == 0 or done == cfg.steps or self._checkpoint_step(done)

    def _checkpoint_step(self, done: int) -> bool:
        cfg = self.cfg
        every = cfg.checkpoint_every and done % cfg.checkpoint_every == 0
        return cfg.save_checkpoint and (done == cfg.steps or bool(every))

    def _upload(self, batches: Sequence[PackedBatch]) -> list[PackedBatch]:
        if self.device.type != "cuda":
            return [b.to(self.device) for b in batches]
        # From pinned memory without blocking: a pageable copy would wait for the device to finish the previous
        # step, a sync in every step.
        return [b.pin_memory().to(self.device, non_blocking=True) for b in batches]

    def step(self) -> None:
        """One optimizer step (``grad_accum`` micro-batches per rank); reads values only at a logged step."""
        cfg, step = self.cfg, self.step_index
        if self.done:
            raise RuntimeError(f"the run is done: all {cfg.steps} steps ran; call finish()")
        if cfg.deterministic and not torch.are_deterministic_algorithms_enabled():
            raise RuntimeError("cfg.deterministic needs deterministic kernels on: step inside deterministic_kernels()")
        t0 = time.perf_counter()
        # Every rank walks the same stream; rank r takes micro-batches r, r + world, ... of the step.
        step_batches = [next(self.data) for _ in range(cfg.grad_accum * self.world)]
        targets = sum(b.num_real_tokens for b in step_batches)  # host ints: no sync
        # Copy this rank's micro-batches up front, so the host launches the forward while they travel.
        mine = self._upload(step_batches[self.rank :: self.world])
        start = _mark(self.device)
        step_loss = accumulate_gradients(self.runner, mine, self.device, autocast=cfg.autocast, total_targets=targets)
        if self.dp is not None:
            step_loss = self.dp.reduce(self.model, step_loss)
        values = [step_loss.float()]
        if cfg.grad_clip > 0:
            values.append(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip).float())
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        row = self._row(step, step_batches, targets, lr)
        self._pending.append(_PendingStep(row, torch.stack(values), start, _mark(self.device)))
        self.step_index = done = step + 1
        if self._is_logged(done):
            self.flush()
        if self.first_step_s is None:
            self.first_step_s = time.perf_counter() - t0
        if self.rank == 0 and self._checkpoint_step(done):
            self.save_checkpoint()

    def _row(self, step: int, batches: Sequence[PackedBatch], targets: int, lr: float) -> dict[str, Any]:
        """The host-known part of a step's log row (loss, grad norm and step time come at the flush)."""
        tokens = sum(sum(b.doc_lengths or ()) for b in batches)
        slots = self.cfg.T * len(batches)
        runner, graphs = self.runner, self.graphs
        return {
            "step": step + 1,
            "loss": None,
            "lr": lr,
            "tokens": tokens,
            "target_tokens": targets,
            "slots": slots,
            "real_token_fraction": tokens / slots,
            "step_ms": None,
            "grad_norm": None,
            "graphs": runner.num_graph_sets if graphs else 0,
            "recaptures": runner.recaptures if graphs else 0,
            "captures": runner.captures + runner.recaptures if graphs else 0,
            "buckets": [[b.max_seqlen, b.capacity] for b in batches],
            "epoch": self.data.epoch,
        }

    def flush(self) -> None:
        """Read every pending step's values in one device-to-host transfer; log, show and keep their rows."""
        if not self._pending:
            return
        values = _to_host(torch.stack([p.values for p in self._pending]))
        rows = []
        for pending, host in zip(self._pending, values, strict=True):
            row = dict(pending.row, loss=host[0], step_ms=_elapsed_ms(pending.start, pending.end))
            row["grad_norm"] = host[1] if len(host) > 1 else None
            rows.append(row)
        self._pending.clear()
        self.rows.extend(rows)
        if self.rank == 0:
            with self.log_path.open("a") as log:
                log.write("".join(json.dumps(r) + "\n" for r in rows))
        for row in rows:
            self._show(row)

    def _show(self, row: dict[str, Any]) -> None:
        cfg, n = self.cfg, row["step"]
        rate = row["tokens"] / max(row["step_ms"], 1e-9) * 1e3
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{rate:,.0f}")
        elif cfg.progress and (n % max(1, cfg.steps // 10) == 0 or n == self.start + 1):
            self._say(f"step {n}/{cfg.steps}  loss {row['loss']:.4f}  lr {row['lr']:.2e}  {rate:,.0f} tok/s")

    def save_checkpoint(self) -> Path:
        """Write ``checkpoint.pt`` (and ``checkpoint-<step>.pt`` every ``checkpoint_every`` steps) for the steps so
        far."""
        done = self.step_index
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": done,
            "rng": _rng_state(self.device),
            "data": self.data.state_dict(),
            "model_config": dataclasses.asdict(self.model_cfg),
            # through JSON: a Path or another object in the config is saved as the string config.json shows
            "train_config": json.loads(json.dumps(dataclasses.asdict(self.cfg), default=str)),
        }
        path = self.out_dir / "checkpoint.pt"
        _save(state, path)
        if self.cfg.checkpoint_every and done % self.cfg.checkpoint_every == 0:
            _save(state, self.out_dir / f"checkpoint-{done:06d}.pt")
        return path

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.rows]

    def finish(self) -> TrainResult:
        """Flush, then write ``summary.json`` and the loss plot; the run's :class:`TrainResult`."""
        self.flush()
        wall = time.perf_counter() - self._t_run
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        cfg, rows, losses = self.cfg, self.rows, self.losses
        if not rows:
            raise RuntimeError("finish() before any step ran")
        tokens_per_s, tokens_per_s_overall = throughput(rows)
        plot_path = None
        if cfg.plot and self.rank == 0:
            curve = {self.mode: [(r["step"], r["loss"]) for r in rows]}
            plot_path = plot_losses(curve, self.out_dir / "loss.png", self._say)
        result = TrainResult(
            out_dir=self.out_dir,
            first_step=self.start,
            losses=losses,
            tokens_per_s=tokens_per_s,
            tokens_per_s_overall=tokens_per_s_overall,
            step_ms_median=sorted(r["step_ms"] for r in rows)[len(rows) // 2],
            tokens=sum(r["tokens"] for r in rows),
            device=str(self.device),
            graphs=self.graphs,
            scope=cfg.scope if self.graphs else None,
            num_graph_sets=self.runner.num_graph_sets if self.graphs else 0,
            recaptures=self.runner.recaptures if self.graphs else 0,
            log_path=self.log_path,
            checkpoint_path=self.out_dir / "checkpoint.pt" if cfg.save_checkpoint else None,
            plot_path=plot_path,
            wall_s=wall,
            first_step_s=float(self.first_step_s or 0.0),
        )
        if self.rank == 0:
            summary = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(result).items()}
            summary.update(first_loss=losses[0], final_loss=losses[-1], world_size=self.world)
            del summary["losses"]
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return result

    def close(self) -> None:
        """Release the progress bar and the process group this trainer started (safe to call twice)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self.dp is not None:
            self.dp.close()
            self.dp = None


def compare_eager_graphed(
    cfg: TrainConfig, *, scopes: Sequence[str] = ("layer",), echo: Callable[[str], None] | None = print
) -> dict[str, Any]:
    """Train the same config (same seed, hence same init and batches) eagerly and graphed per scope.

    Runs go to ``<out_dir>/eager`` and ``<out_dir>/graphed-<scope>``. Returns ``{"runs": {name: TrainResult},
    "max_abs_loss_diff": {name: float}, "speedup": {name: float}}`` (graphed vs eager, per scope).
    """
    base = Path(cfg.out_dir) if cfg.out_dir else default_out_dir("compare")
    runs = {"eager": train(dataclasses.replace(cfg, graphs=False, out_dir=str(base / "eager")), echo=echo)}
    for scope in scopes:
        name = f"graphed-{scope}"
        runs[name] = train(dataclasses.replace(cfg, graphs=True, scope=scope, out_dir=str(base / name)), echo=echo)
    eager = runs["eager"]
    diffs = {
        n: max(abs(a - b) for a, b in zip(eager.losses, r.losses, strict=False))
        for n, r in runs.items()
        if n != "eager"
    }
    speedups = {n: r.tokens_per_s / eager.tokens_per_s for n, r in runs.items() if n != "eager"}
    return {"runs": runs, "max_abs_loss_diff": diffs, "speedup": speedups}
