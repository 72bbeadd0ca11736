"""The training loop: :class:`Trainer` runs a config one optimizer step at a time, :func:`train` runs it to the
end (see :mod:`packgraph.train` for the step, the host syncs and the artefacts).

Every file of a run but ``train.jsonl`` (appended to at logged steps) is written whole or not at all
(:func:`~packgraph.train.logs.atomic_open`). A run writes over what an earlier run left in its out dir;
``packgraph train`` refuses such a dir unless it resumes that run or is told to overwrite it (then it deletes
:func:`run_files` first)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from packgraph.data.stream import DataStream, corpus_documents
from packgraph.graphs.recorder import loop_stream, stand_in
from packgraph.models.gpt import GPT
from packgraph.packing import PackedBatch
from packgraph.train.checkpoint import (
    check_resumable,
    load_checkpoint,
    restore_training_state,
    training_state,
    write_checkpoint,
)
from packgraph.train.config import TrainConfig, default_out_dir, resolve_device
from packgraph.train.logs import largest, plot_losses, throughput, truncate_log, write_text_atomically
from packgraph.train.parallel import DataParallelGroup
from packgraph.train.step import accumulate_gradients, deterministic_kernels, lr_factor, make_optimizer

__all__ = ["TrainResult", "Trainer", "train", "compare_eager_graphed", "run_files"]

# What a run writes in its out dir, and the .tmp files that a write cut short leaves (checkpoint[-<step>].tmp: those
# of earlier versions). The CLI's --overwrite deletes these and nothing else.
_RUN_FILE = re.compile(
    r"(config\.json|train\.jsonl|summary\.json|loss\.png|checkpoint(-\d+)?\.pt)(\.tmp)?|checkpoint(-\d+)?\.tmp"
)


def run_files(out_dir: str | os.PathLike) -> list[Path]:
    """The files of a training run in ``out_dir``, sorted: ``config.json``, ``train.jsonl``, ``summary.json``,
    ``loss.png``, ``checkpoint.pt``, ``checkpoint-<step>.pt`` and the ``.tmp`` files of an interrupted write of
    any of them. Empty when ``out_dir`` is not a directory; other files in it are not listed."""
    d = Path(out_dir)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if _RUN_FILE.fullmatch(p.name) and not p.is_dir())


@dataclass
class TrainResult:
    """What a run did. ``losses[i]`` is the loss of step ``first_step + i + 1`` (1-based steps in logs).

    ``tokens_per_s`` is the steady rate and ``tokens_per_s_overall`` the rate over every step (see
    :func:`~packgraph.train.logs.throughput`); tokens are real document tokens, not padded slots. Step times are
    CUDA events on CUDA (from the step's first kernel to its optimizer update, data loading left out) and wall
    clock on the CPU. ``first_step_s`` is the wall time of the run's first step until its loss is on the host:
    captures, lazy initialisation and all.
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


def _progress(total: int, initial: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


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
        self,
        cfg: TrainConfig,
        *,
        echo: Callable[[str], None] | None = print,
        documents: Sequence[Tensor] | None = None,
        prepare_out_dir: Callable[[], None] | None = None,
    ) -> None:
        cfg.validate()
        device = resolve_device(cfg.device)
        cfg = cfg.resolved(device, echo)
        self.cfg = cfg
        self._prepare_out_dir = prepare_out_dir
        self.graphs = device.type == "cuda" if cfg.graphs is None else cfg.graphs
        if self.graphs and device.type != "cuda" and stand_in() is None:  # (a stand-in recorder: CPU tests)
            raise ValueError("CUDA graphs need a CUDA device; run with --no-graphs (eager) or on a GPU")
        ckpt = load_checkpoint(cfg.resume) if cfg.resume else None
        if ckpt is not None:
            check_resumable(ckpt, cfg)
        self.out_dir = Path(cfg.out_dir) if cfg.out_dir else default_out_dir("train")
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise ValueError(f"out dir {self.out_dir} exists and is not a directory")
        self.dp = DataParallelGroup.from_env(device, cfg.dp_engine)
        self.device = self.dp.device if self.dp is not None else device
        self.rank, self.world = (self.dp.rank, self.dp.world) if self.dp is not None else (0, 1)
        self._say = (echo if self.rank == 0 else None) or (lambda _msg: None)
        self._bar = None
        try:
            self._setup(ckpt, documents)
        except BaseException:
            self.close()  # the process group this trainer started
            raise

    # ------------------------------------------------------------------------------------------ build
    def _setup(self, ckpt: dict[str, Any] | None, documents: Sequence[Tensor] | None) -> None:
        cfg = self.cfg
        self._build(documents)
        self.start = self._resume(ckpt) if ckpt is not None else 0
        self.step_index = self.start
        if self.dp is not None:
            self.dp.broadcast(self.model)
        self.log_path = self.out_dir / "train.jsonl"
        if self.rank == 0:
            # Only now: a run refused above (a config or a checkpoint that does not fit) leaves the out dir as it
            # was (no empty dir, and nothing of an earlier run deleted by prepare_out_dir).
            if self._prepare_out_dir is not None:
                self._prepare_out_dir()
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._open_log(resumed=ckpt is not None)
        self.runner = self.model.graphed(scope=cfg.scope) if self.graphs else self.model
        # What a step calls: the runner, inside DDP under data parallelism (packgraph.train.parallel).
        self.step_module = self.dp.wrap(self.runner) if self.dp is not None else self.runner
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
        self.optimizer = make_optimizer(self.model, cfg)
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
        return restore_training_state(ckpt, **self._state_parts())

    def _state_parts(self) -> dict[str, Any]:
        """What a checkpoint saves and restores, by :func:`~packgraph.train.checkpoint.training_state`'s names."""
        return dict(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            data=self.data,
            device=self.device,
            model_config=self.model_cfg,
            train_config=self.cfg,
        )

    def _open_log(self, *, resumed: bool) -> None:
        """Write ``config.json``; start ``train.jsonl`` empty, or cut a resumed run's log after its last step."""
        config = json.dumps(dataclasses.asdict(self.cfg), indent=2, default=str)
        write_text_atomically(self.out_dir / "config.json", config + "\n")
        if resumed:
            truncate_log(self.log_path, self.start)
        else:
            self.log_path.write_text("")

    def _announce(self) -> None:
        cfg = self.cfg
        ranks = f" x {self.world} ranks" if self.world > 1 else ""
        self._say(
            f"train: {cfg.preset} ({self.model_cfg.num_params() / 1e6:.2f}M params) on {self.device}, {self.mode}; "
            f"steps {self.start + 1}..{cfg.steps}, T={cfg.T} x {cfg.grad_accum}{ranks}, {len(self.docs)} docs in "
            f"{self.data.bins_per_epoch} bins/epoch (efficiency {self.data.packing.efficiency:.3f}); "
            f"out dir {self.out_dir}"
        )

    # ------------------------------------------------------------------------------------------ step
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

    def _check_steppable(self) -> None:
        if self.done:
            raise RuntimeError(f"the run is done: all {self.cfg.steps} steps ran; call finish()")
        if self.cfg.deterministic and not torch.are_deterministic_algorithms_enabled():
            raise RuntimeError("cfg.deterministic needs deterministic kernels on: step inside deterministic_kernels()")

    def _upload(self, batches: Sequence[PackedBatch]) -> list[PackedBatch]:
        if self.device.type != "cuda":
            return [b.to(self.device) for b in batches]
        # From pinned memory without blocking: a pageable copy would wait for the device to finish the previous
        # step, a sync in every step.
        return [b.pin_memory().to(self.device, non_blocking=True) for b in batches]

    def step(self) -> None:
        """One optimizer step (``grad_accum`` micro-batches per rank); reads values only at a logged step."""
        self._check_steppable()
        step, t0 = self.step_index, time.perf_counter()
        # Every rank walks the same stream; rank r takes micro-batches r, r + world, ... of the step.
        step_batches = [next(self.data) for _ in range(self.cfg.grad_accum * self.world)]
        targets = sum(b.num_real_tokens for b in step_batches)  # host ints: no sync
        # Copy this rank's micro-batches up front, so the host launches the forward while they travel.
        mine = self._upload(step_batches[self.rank :: self.world])
        start = _mark(self.device)
        values = [self.forward_backward(mine, targets).float()]
        lr = self.optimizer.param_groups[0]["lr"]  # this step's: optimizer_step moves the schedule on
        grad_norm = self.optimizer_step()
        if grad_norm is not None:
            values.append(grad_norm)
        row = self._row(step, step_batches, targets, lr)
        self._pending.append(_PendingStep(row, torch.stack(values), start, _mark(self.device)))
        self.step_index = done = step + 1
        if self._is_logged(done):
            self.flush()
        if self.first_step_s is None:
            self.first_step_s = time.perf_counter() - t0
        if self.rank == 0 and self._checkpoint_step(done):
            self.save_checkpoint()

    def forward_backward(self, micro_batches: Sequence[PackedBatch], targets: int) -> Tensor:
        """Forward and backward this rank's micro-batches, gradients summed over the ranks; the step's loss, on the
        device. ``targets``: the real target tokens of the step's micro-batches on every rank."""
        cfg = self.cfg
        no_sync = self.dp.no_sync if self.dp is not None else None
        loss = accumulate_gradients(
            self.step_module, micro_batches, self.device, autocast=cfg.autocast, total_targets=targets, no_sync=no_sync
        )
        if self.dp is not None:
            loss = self.dp.reduce(self.model, loss)
        return loss

    def optimizer_step(self) -> Tensor | None:
        """Clip the gradients, step the optimizer and the schedule, drop the gradients. The gradient norm before
        clipping (float32, on the device), or ``None`` when clipping is off."""
        grad_norm = None
        if self.cfg.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip).float()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    # ------------------------------------------------------------------------------------------ log
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

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.rows]

    # ------------------------------------------------------------------------------------------ checkpoint
    def save_checkpoint(self) -> Path:
        """Write ``checkpoint.pt`` (and ``checkpoint-<step>.pt`` every ``checkpoint_every`` steps) for the steps so
        far."""
        done = self.step_index
        state = training_state(step=done, **self._state_parts())
        path = self.out_dir / "checkpoint.pt"
        write_checkpoint(state, path)
        if self.cfg.checkpoint_every and done % self.cfg.checkpoint_every == 0:
            write_checkpoint(state, self.out_dir / f"checkpoint-{done:06d}.pt")
        return path

    # ------------------------------------------------------------------------------------------ finish
    def finish(self) -> TrainResult:
        """Flush, then write ``summary.json`` and the loss plot; the run's :class:`TrainResult`."""
        self.flush()
        wall = time.perf_counter() - self._t_run
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if not self.rows:
            raise RuntimeError("finish() before any step ran")
        plot_path = None
        if self.cfg.plot and self.rank == 0:
            curve = {self.mode: [(r["step"], r["loss"]) for r in self.rows]}
            plot_path = plot_losses(curve, self.out_dir / "loss.png", self._say)
        result = self._result(wall, plot_path)
        if self.rank == 0:
            self._write_summary(result)
        return result

    def _result(self, wall: float, plot_path: Path | None) -> TrainResult:
        cfg, rows, graphs = self.cfg, self.rows, self.graphs
        tokens_per_s, tokens_per_s_overall = throughput(rows)
        return TrainResult(
            out_dir=self.out_dir,
            first_step=self.start,
            losses=self.losses,
            tokens_per_s=tokens_per_s,
            tokens_per_s_overall=tokens_per_s_overall,
            step_ms_median=sorted(r["step_ms"] for r in rows)[len(rows) // 2],
            tokens=sum(r["tokens"] for r in rows),
            device=str(self.device),
            graphs=graphs,
            scope=cfg.scope if graphs else None,
            num_graph_sets=self.runner.num_graph_sets if graphs else 0,
            recaptures=self.runner.recaptures if graphs else 0,
            log_path=self.log_path,
            checkpoint_path=self.out_dir / "checkpoint.pt" if cfg.save_checkpoint else None,
            plot_path=plot_path,
            wall_s=wall,
            first_step_s=float(self.first_step_s or 0.0),
        )

    def _write_summary(self, result: TrainResult) -> None:
        summary = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(result).items()}
        summary.update(first_loss=result.losses[0], final_loss=result.losses[-1], world_size=self.world)
        del summary["losses"]
        write_text_atomically(self.out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")

    def close(self) -> None:
        """Release the progress bar and the process group this trainer started (safe to call twice)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self.dp is not None:
            self.step_module = getattr(self, "runner", None)  # DDP's last reference here (dp.close drops it first)
            self.dp.close()
            self.dp = None


def train(
    cfg: TrainConfig,
    *,
    echo: Callable[[str], None] | None = print,
    prepare_out_dir: Callable[[], None] | None = None,
) -> TrainResult:
    """Run ``cfg`` to its last step; see :mod:`packgraph.train` for the step and the artefacts.

    ``prepare_out_dir`` runs (on the first rank) just before the run writes anything, once the config and any
    checkpoint have been checked and restored: the CLI's ``--overwrite`` deletes the earlier run's files there, so
    a refused run deletes nothing.

    With ``cfg.deterministic`` every kernel is deterministic (:func:`deterministic_kernels`): two runs of one
    config give the same losses bit for bit, and so do eager and graphed runs (the graphs replay the same kernels
    on the same data).

    Raises:
        ValueError: bad config (including graphs requested without CUDA).
        FileNotFoundError: ``resume`` names no checkpoint.
    """
    # One stream for the whole run: the graphs' cuBLAS workspaces are the eager code's (packgraph.graphs.recorder).
    with deterministic_kernels(cfg.deterministic), loop_stream(resolve_device(cfg.device)):
        trainer = Trainer(cfg, echo=echo, prepare_out_dir=prepare_out_dir)
        try:
            while not trainer.done:
                trainer.step()
            return trainer.finish()
        finally:
            trainer.close()


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
        n: largest([abs(a - b) for a, b in zip(eager.losses, r.losses, strict=False)])[0]
        for n, r in runs.items()
        if n != "eager"
    }
    speedups = {n: r.tokens_per_s / eager.tokens_per_s for n, r in runs.items() if n != "eager"}
    return {"runs": runs, "max_abs_loss_diff": diffs, "speedup": speedups}
