"""Train the reference GPT on the embedded corpus, eagerly or with CUDA graphs.

One step: ``grad_accum`` micro-batches of ``T`` rows each, forward + backward (bf16 autocast on CUDA), gradient
clipping, AdamW (fused on CUDA), then the learning-rate schedule (linear warm-up, cosine decay to
``min_lr_ratio * lr``). Micro-batch losses are weighted by their share of the step's real target tokens, so the
step's gradient is that of the mean CE over every target token of the step (see :mod:`packgraph.models.gpt`).

Data order is deterministic (:mod:`packgraph.data.stream`): corpus pieces of seeded random length, packed once,
each epoch visiting the bins in an order shuffled by ``(seed, epoch)``. The data position is ``(epoch, bin
index)``, so a checkpoint resumes on the very next batch. Log reading, smoothing and plots live in
:mod:`packgraph.runlog`.

Artefacts, under ``out_dir``: ``config.json``, ``train.jsonl`` (one row per step), ``checkpoint.pt`` (latest;
``checkpoint-<step>.pt`` every ``checkpoint_every`` steps), ``summary.json`` and ``loss.png`` (needs matplotlib).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
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
from packgraph.models.gpt import GPT, SCOPES, GPTConfig
from packgraph.packing import PACKING_ALGORITHMS, PackedBatch
from packgraph.runlog import plot_losses, throughput

__all__ = [
    "TrainConfig",
    "TrainResult",
    "train",
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
    :func:`~packgraph.runlog.throughput`); tokens are real document tokens, not padded slots.
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

        allreduce_gradients(model.parameters())
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
    kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": tuple(cfg.betas)}
    if device.type == "cuda":
        kwargs["fused"] = True
    return torch.optim.AdamW(groups, **kwargs)


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
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
    """A training checkpoint (a file, or a run dir holding ``checkpoint.pt``), loaded on the CPU.

    Raises:
        FileNotFoundError: nothing there.
        ValueError: unreadable, or not a packgraph training checkpoint (names the missing keys).
    """
    file = _resolve_checkpoint(path)
    try:
        ckpt = torch.load(file, map_location="cpu", weights_only=False)
    except Exception as e:  # a corrupt or foreign file
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


def _save(obj: dict[str, Any], path: Path) -> None:
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
    """Run ``cfg``; see the module docstring for the step and the artefacts.

    With ``cfg.deterministic`` every kernel is deterministic (:func:`deterministic_kernels`): two runs of one
    config give the same losses bit for bit, and so do eager and graphed runs (the graphs replay the same kernels
    on the same data).

    Raises:
        ValueError: bad config (including graphs requested without CUDA).
        FileNotFoundError: ``resume`` names no checkpoint.
    """
    with deterministic_kernels(cfg.deterministic):
        return _train(cfg, echo=echo)


def _train(cfg: TrainConfig, *, echo: Callable[[str], None] | None) -> TrainResult:
    cfg.validate()
    device = resolve_device(cfg.device)
    graphs = device.type == "cuda" if cfg.graphs is None else cfg.graphs
    if graphs and device.type != "cuda":
        raise ValueError("CUDA graphs need a CUDA device; run with --no-graphs (eager) or on a GPU")
    ckpt = load_checkpoint(cfg.resume) if cfg.resume else None
    if ckpt is not None:
        _check_resumable(ckpt, cfg)
    out_dir = Path(cfg.out_dir) if cfg.out_dir else default_out_dir("train")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"out dir {out_dir} exists and is not a directory")
    dp = _DataParallel.from_env(device)
    device = dp.device if dp is not None else device
    rank, world = (dp.rank, dp.world) if dp is not None else (0, 1)
    say = (echo if rank == 0 else None) or (lambda _msg: None)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)

    # The model is built on the CPU from the seed, then moved: the same init on every device.
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    model_cfg = cfg.model_config()
    model = GPT(model_cfg).to(device)
    optimizer = _make_optimizer(model, cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(
            s, warmup=min(cfg.warmup_steps, cfg.steps - 1), total=cfg.steps, min_ratio=cfg.min_lr_ratio
        ),
    )
    policy = cfg.bucket_policy()
    docs = corpus_documents(cfg)
    data = DataStream(
        docs, T=cfg.T, policy=policy, seed=cfg.seed, algorithm=cfg.algorithm, pad_to_multiple=cfg.pad_to_multiple
    )

    start = 0
    if ckpt is not None:
        if ckpt["model_config"] != dataclasses.asdict(model_cfg):
            raise ValueError(f"checkpoint {cfg.resume} holds a different model: {ckpt['model_config']}")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        data.load_state_dict(ckpt["data"])
        start = int(ckpt["step"])
        if start >= cfg.steps:
            raise ValueError(f"checkpoint is at step {start}; ask for more steps than that (got --steps {cfg.steps})")
        _set_rng_state(ckpt["rng"], device)
    if dp is not None:
        dp.broadcast(model)
    if rank == 0:
        (out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2, default=str) + "\n")

    runner = model.graphed(scope=cfg.scope) if graphs else model
    params = list(model.parameters())
    log_path = out_dir / "train.jsonl"
    mode = "graphed, scope " + cfg.scope if graphs else "eager"
    ranks = f" x {world} ranks" if world > 1 else ""
    say(
        f"train: {cfg.preset} ({model_cfg.num_params() / 1e6:.2f}M params) on {device}, {mode}; steps {start + 1}.."
        f"{cfg.steps}, T={cfg.T} x {cfg.grad_accum}{ranks}, {len(docs)} docs in {data.bins_per_epoch} bins/epoch "
        f"(efficiency {data.packing.efficiency:.3f}); out dir {out_dir}"
    )

    losses: list[float] = []
    rows: list[dict[str, Any]] = []
    bar = _progress(cfg.steps, start, cfg.progress and rank == 0)
    t_run = time.perf_counter()
    model.train()
    slots = cfg.T * cfg.grad_accum * world
    if ckpt is not None and rank == 0:
        _truncate_log(log_path, start)
    with log_path.open("a" if ckpt is not None else "w") if rank == 0 else contextlib.nullcontext() as log:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            # Every rank walks the same stream; rank r takes micro-batches r, r + world, ... of the step.
            step_batches = [next(data) for _ in range(cfg.grad_accum * world)]
            targets = [b.num_real_tokens for b in step_batches]  # host ints: no sync
            tokens = sum(sum(b.doc_lengths or ()) for b in step_batches)
            # Copy this rank's micro-batches up front: a blocking copy later would wait for the previous
            # micro-batch's backward and leave the device idle while the host launches the next forward.
            mine = [b.to(device) for b in step_batches[rank::world]]
            step_loss = accumulate_gradients(runner, mine, device, autocast=cfg.autocast, total_targets=sum(targets))
            if dp is not None:
                step_loss = dp.reduce(model, step_loss)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if cfg.grad_clip > 0 else None
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            loss_value = float(step_loss)  # the one sync per step
            dt = time.perf_counter() - t0
            losses.append(loss_value)
            row = {
                "step": step + 1,
                "loss": loss_value,
                "lr": lr,
                "tokens": tokens,
                "target_tokens": sum(targets),
                "slots": slots,
                "real_token_fraction": tokens / slots,
                "step_ms": dt * 1e3,
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "graphs": runner.num_graph_sets if graphs else 0,
                "recaptures": runner.recaptures if graphs else 0,
                "captures": runner.captures + runner.recaptures if graphs else 0,
                "buckets": [[b.max_seqlen, b.capacity] for b in step_batches],
                "epoch": data.epoch,
            }
            rows.append(row)
            if log is not None:
                log.write(json.dumps(row) + "\n")
                log.flush()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{tokens / dt:,.0f}")
            elif cfg.progress and ((step + 1) % max(1, cfg.steps // 10) == 0 or step == start):
                say(f"step {step + 1}/{cfg.steps}  loss {loss_value:.4f}  lr {lr:.2e}  {tokens / dt:,.0f} tok/s")
            done = step + 1
            if (
                rank == 0
                and cfg.save_checkpoint
                and (done == cfg.steps or (cfg.checkpoint_every and done % cfg.checkpoint_every == 0))
            ):
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "step": done,
                    "rng": _rng_state(device),
                    "data": data.state_dict(),
                    "model_config": dataclasses.asdict(model_cfg),
                    "train_config": dataclasses.asdict(cfg),
                }
                _save(state, out_dir / "checkpoint.pt")
                if cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
                    _save(state, out_dir / f"checkpoint-{done:06d}.pt")
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - t_run

    tokens_per_s, tokens_per_s_overall = throughput(rows)
    plot_path = None
    if cfg.plot and rank == 0:
        plot_path = plot_losses({mode: [(start + i + 1, v) for i, v in enumerate(losses)]}, out_dir / "loss.png", say)
    result = TrainResult(
        out_dir=out_dir,
        first_step=start,
        losses=losses,
        tokens_per_s=tokens_per_s,
        tokens_per_s_overall=tokens_per_s_overall,
        step_ms_median=sorted(r["step_ms"] for r in rows)[len(rows) // 2],
        tokens=sum(r["tokens"] for r in rows),
        device=str(device),
        graphs=graphs,
        scope=cfg.scope if graphs else None,
        num_graph_sets=runner.num_graph_sets if graphs else 0,
        recaptures=runner.recaptures if graphs else 0,
        log_path=log_path,
        checkpoint_path=out_dir / "checkpoint.pt" if cfg.save_checkpoint else None,
        plot_path=plot_path,
        wall_s=wall,
    )
    if rank == 0:
        summary = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(result).items()}
        summary.update(first_loss=losses[0], final_loss=losses[-1], world_size=world)
        del summary["losses"]
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if dp is not None:
        dp.close()
    return result


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
