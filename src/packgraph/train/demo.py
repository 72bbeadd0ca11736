"""``packgraph demo``: a newcomer's first run, which says what is true at a glance.

In order:

1. **Data.** The embedded corpus (the running Python's standard library, one document per file, byte tokens)
   is packed into bins of ``T`` rows by three packers (their efficiency is printed), and the bins are mapped to
   the bucket policy (how often each bucket is used, how full its batches are).
2. **Training.** The GPT trains eagerly. On CUDA the same config also trains under CUDA graphs, once per scope
   (``layer`` and ``model`` by default): same seed, so the same init and the same batches.
3. **Losses.** With deterministic kernels (the default, :func:`~packgraph.train.deterministic_kernels`) a graphed
   run replays the kernels eager runs on the same data, so its loss curve must equal eager's bit for bit: the demo
   says "bitwise equal", or prints the largest difference and says that it is a bug. Without them
   (``deterministic=False``, ``packgraph demo --fast``) a second eager run measures how far two eager runs drift
   apart, which is printed beside the graphed runs' difference as its cause.
4. **Speed.** Each run's step time is the median, over the same steps of every run, of CUDA events (wall clock
   on the CPU): after a warm-up, leaving out the steps in which any graphed run captured graphs and the profiled
   steps. Beside each speedup stand the GPU-busy time per step (kernel time under ``torch.profiler``, the bench's
   :func:`~packgraph.bench.profiling.gpu_busy_ms`) over the last steps of every run, the step / busy ratio over
   those same steps, and the time to the first step (captures included). Every run first trains up to those last
   steps, then the last steps of every run are profiled: no capture follows a profiler session in the process.

Artefacts in the out dir: ``demo.json`` (every printed figure, and each run's losses), ``demo.png`` (the loss
curves on one axis; step time and GPU-busy time per method) and one run directory per method (``train.jsonl``,
``config.json``, ``summary.json``). The last line printed names ``demo.png`` and ``demo.json``. This module runs
the demo; :mod:`packgraph.train.demo_report` turns its runs into figures, text and the plot.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from packgraph.data.corpus import corpus_stats
from packgraph.data.stream import DataStream, corpus_documents
from packgraph.graphs.recorder import loop_stream, stand_in
from packgraph.packing import pack_sequences
from packgraph.train.config import TrainConfig, default_out_dir, resolve_device
from packgraph.train.demo_report import DemoRun, Echo, method_figures, plot_demo, print_report, step_timing
from packgraph.train.logs import text_table
from packgraph.train.step import deterministic_kernels
from packgraph.train.trainer import Trainer

__all__ = ["DEFAULTS", "demo_defaults", "demo_settings", "run_demo"]

DEFAULTS: dict[str, dict[str, Any]] = {
    # CPU: seconds on a 2-core laptop. CUDA: a model big enough that the GPU, not Python, sets the eager pace.
    "cpu": dict(preset="tiny", T=512, steps=50, max_docs=200),
    "cuda": dict(preset="small", T=4096, steps=100, max_docs=None),
}

GPU_ADDS = (
    "a GPU run adds: the same batches trained under CUDA graphs (scopes layer and model), their losses checked "
    "against eager bit for bit, and each method's step time beside its GPU-busy time"
)


def demo_defaults(device: torch.device) -> dict[str, Any]:
    """The demo's preset, ``T``, steps and ``max_docs`` on ``device`` (see :data:`DEFAULTS`)."""
    return dict(DEFAULTS["cuda" if device.type == "cuda" else "cpu"])


def demo_settings(
    device: torch.device, *, preset: str | None, T: int | None, steps: int | None, max_docs: int | None, fast: bool
) -> dict[str, Any]:
    """The demo's :class:`~packgraph.train.TrainConfig` fields on ``device``: the given values, or
    :func:`demo_defaults` for those that are ``None``, and the demo's own settings (deterministic kernels unless
    ``fast``; no progress bar, plot or checkpoint)."""
    defaults = demo_defaults(device)
    steps = steps or defaults["steps"]
    return dict(
        preset=preset or defaults["preset"],
        T=T or defaults["T"],
        steps=steps,
        warmup_steps=max(1, steps // 10),
        max_docs=max_docs or defaults["max_docs"],
        progress=False,
        plot=False,
        save_checkpoint=False,
        deterministic=not fast,
        log_every=10,  # the host runs ahead of the device between reads, as a real training loop would
    )


# ---------------------------------------------------------------------------------------------- data
def _data_report(cfg: TrainConfig, docs: Sequence[torch.Tensor], echo: Echo) -> tuple[DataStream, dict[str, Any]]:
    """Print the corpus, packing and bucket tables; return the stream (fresh) and their figures."""
    policy = cfg.bucket_policy()
    stats = corpus_stats(docs)
    echo(f"corpus: {cfg.max_docs or 'all'} stdlib files cut into {stats}")
    lengths = [len(d) for d in docs]
    packing, rows = {}, []
    for algorithm in ("ffd", "bfd", "nfd"):
        p = pack_sequences(lengths, cfg.T, max_seqs_per_bin=policy.max_capacity, algorithm=algorithm)
        packing[algorithm] = {"bins": len(p), "efficiency": p.efficiency}
        rows.append([algorithm, len(p), f"{p.efficiency:.4f}"])
    echo(f"\npacking into bins of T={cfg.T} rows (at most {policy.max_capacity} documents each):")
    echo(text_table(rows, ["algorithm", "bins", "efficiency"]))

    data = DataStream(
        docs, T=cfg.T, policy=policy, seed=cfg.seed, algorithm=cfg.algorithm, pad_to_multiple=cfg.pad_to_multiple
    )
    counts: Counter = Counter()
    fill: Counter = Counter()
    for b in data.packing:
        bucket = policy.bucket_for(max(data.packing.lengths[i] for i in b), len(b))
        counts[bucket] += 1
        fill[bucket] += sum(data.packing.lengths[i] for i in b)
    used = [
        {
            "max_seqlen": b.max_seqlen,
            "capacity": b.capacity,
            "batches": n,
            "share": n / len(data.packing),
            "real_token_fraction": fill[b] / (n * cfg.T),
        }
        for b, n in sorted(counts.items())
    ]
    echo(f"\n{policy.describe()}; {len(counts)} used:")
    table = [
        [u["max_seqlen"], u["capacity"], u["batches"], f"{u['share']:.1%}", f"{u['real_token_fraction']:.3f}"]
        for u in used
    ]
    echo(text_table(table, ["max_seqlen", "capacity", "batches", "share", "real-token fraction"]))
    corpus = {"files": cfg.max_docs, **dataclasses.asdict(stats), "summary": str(stats)}
    return data, {"corpus": corpus, "packing": packing, "buckets": {"policy": policy.describe(), "used": used}}


def _new_signature_steps(data: DataStream, cfg: TrainConfig) -> set[int]:
    """0-based steps whose batches include a static signature not seen before: where graphed runs capture."""
    seen: set[Any] = set()
    steps = set()
    for step in range(cfg.steps):
        for _ in range(cfg.grad_accum):
            signature = next(data).static_signature()
            if signature not in seen:
                seen.add(signature)
                steps.add(step)
    return steps


# ---------------------------------------------------------------------------------------------- runs
def _plan(cfg: TrainConfig, scopes: Sequence[str]) -> list[DemoRun]:
    out = Path(cfg.out_dir or ".")

    def run(name: str, label: str, graphs: bool, scope: str = cfg.scope, timed: bool = True) -> DemoRun:
        c = dataclasses.replace(cfg, graphs=graphs, scope=scope, out_dir=str(out / name), plot=False, progress=False)
        return DemoRun(name, label, c, timed=timed)

    runs = [run("eager", "eager", False)]
    runs += [run(f"graphed-{s}", f"graphed {s}", True, s) for s in scopes]
    if scopes and not cfg.deterministic:
        # The control: two eager runs' drift is what non-deterministic kernels alone do.
        runs.append(run("eager-rerun", "eager (rerun)", False, timed=False))
    return runs


def _train_all(
    runs: list[DemoRun],
    docs: Sequence[torch.Tensor],
    window_start: int,
    echo: Echo,
    profile: Callable[[Trainer], Any] | None = None,
) -> None:
    """Train every timed run to ``window_start``, and each control run to its end; then run the remaining steps of
    each under ``profile`` (which must step the trainer to its end and return a ``KernelProfile``), and finish it.
    """
    trainers: dict[str, Trainer] = {}
    # One stream for every run: the graphs' cuBLAS workspaces are the eager code's (packgraph.graphs.recorder).
    with loop_stream(resolve_device(runs[0].cfg.device)):
        try:
            for run in runs:
                t0 = time.perf_counter()
                trainer = trainers[run.name] = Trainer(run.cfg, echo=None, documents=docs)
                stop = window_start if run.timed else run.cfg.steps
                while trainer.step_index < stop:
                    trainer.step()
                echo(f"  {run.label:<14} steps 1-{stop} in {time.perf_counter() - t0:.1f} s")
            if profile is not None and window_start < runs[0].cfg.steps:
                echo(f"  profiling steps {window_start + 1}-{runs[0].cfg.steps} of each run (torch.profiler, kernels)")
            for run in runs:
                trainer = trainers[run.name]
                if not trainer.done and profile is not None:
                    run.busy = profile(trainer)
                while not trainer.done:
                    trainer.step()
                run.result = trainer.finish()
                run.rows = list(trainer.rows)
        finally:
            for trainer in trainers.values():
                trainer.close()


def _profile(trainer: Trainer) -> Any:
    """The trainer's remaining steps under the bench's GPU-busy profiler."""
    from packgraph.bench.profiling import gpu_busy_ms  # CUDA only: keeps torch._dynamo out of a CPU demo

    steps = trainer.cfg.steps - trainer.step_index
    return gpu_busy_ms(lambda _i: trainer.step(), steps=steps)


# ---------------------------------------------------------------------------------------------- the demo
def _about(cfg: TrainConfig, device: torch.device) -> dict[str, Any]:
    cuda, threads = device.type == "cuda", torch.get_num_threads()
    return {
        "command": "packgraph demo",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else f"{platform.machine()}, {threads} threads",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "preset": cfg.preset,
        "params": cfg.model_config().num_params(),
        "T": cfg.T,
        "steps": cfg.steps,
        "seed": cfg.seed,
        "deterministic": cfg.deterministic,
        "precision": "bf16 autocast" if cuda and cfg.autocast else "float32",
    }


def run_demo(
    cfg: TrainConfig, *, scopes: Sequence[str] = ("layer", "model"), profile_steps: int = 5, echo: Echo = print
) -> dict[str, Any]:
    """Run the demo on ``cfg`` (the eager run's config: device, preset, ``T``, steps, data, ``deterministic``) and
    return what ``demo.json`` holds. See the module docstring.

    Args:
        scopes: graphed runs, one per scope (CUDA only; pass ``()`` for an eager-only demo).
        profile_steps: the last steps of every run, profiled for GPU-busy time (CUDA).

    Raises:
        ValueError: graphed scopes without CUDA, or a bad config.
    """
    cfg.validate()
    device = resolve_device(cfg.device)
    cfg = cfg.resolved(device, echo)
    cuda = device.type == "cuda"
    if scopes and not cuda and stand_in() is None:  # (a stand-in recorder: CPU tests of the graphed runs)
        raise ValueError("the graphed runs need CUDA; pass scopes=() for an eager-only demo on this device")
    out = Path(cfg.out_dir) if cfg.out_dir else default_out_dir("demo")
    cfg = dataclasses.replace(cfg, out_dir=str(out))
    out.mkdir(parents=True, exist_ok=True)
    summary = _about(cfg, device)
    echo(f"packgraph demo on {device} ({summary['device_name']}); out dir: {out}")
    docs = corpus_documents(cfg)
    data, figures = _data_report(cfg, docs, echo)
    summary.update(figures)

    runs = _plan(cfg, scopes)
    last_capture = max(_new_signature_steps(data, cfg), default=-1) if scopes else -1
    window_start = max(cfg.steps - profile_steps, last_capture + 1, 1) if cuda and profile_steps > 0 else cfg.steps
    kernels = "deterministic kernels" if cfg.deterministic else "non-deterministic kernels (--fast)"
    echo(
        f"\ntraining {cfg.preset} ({summary['params'] / 1e6:.2f}M params) for {cfg.steps} steps on the same batches, "
        f"{summary['precision']}, {kernels}:"
    )
    with deterministic_kernels(cfg.deterministic):
        _train_all(runs, docs, min(window_start, cfg.steps), echo, _profile if cuda else None)
    timing = step_timing(runs, cfg, min(window_start, cfg.steps), device)
    methods = method_figures(runs, timing)
    verdict = print_report(cfg, runs, methods, timing, echo)
    summary["timing"] = {k: v for k, v in timing.items() if not k.startswith("_")}
    summary["methods"] = methods
    if not scopes:
        echo(
            f"\n(no CUDA here) {GPU_ADDS}"
            if not cuda
            else "\n(eager only: without --no-graphs the demo adds graphed runs)"
        )
    png = plot_demo(runs, methods, verdict, out / "demo.png", echo)
    summary["files"] = {"png": str(png) if png else None, "json": str(out / "demo.json")}
    (out / "demo.json").write_text(json.dumps(summary, indent=2, allow_nan=True) + "\n")
    echo(f"wrote {png} and {out / 'demo.json'}" if png else f"wrote {out / 'demo.json'} (no demo.png: no matplotlib)")
    return summary
