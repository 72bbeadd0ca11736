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
   :func:`~packgraph.bench_methods.gpu_busy_ms`) over the last steps of every run, the step / busy ratio over
   those same steps, and the time to the first step (captures included). Every run first trains up to those last
   steps, then the last steps of every run are profiled: no capture follows a profiler session in the process.

Artefacts in the out dir: ``demo.json`` (every printed figure, and each run's losses), ``demo.png`` (the loss
curves on one axis; step time and GPU-busy time per method) and one run directory per method (``train.jsonl``,
``config.json``, ``summary.json``). The last line printed names ``demo.png`` and ``demo.json``.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from packgraph.data.corpus import corpus_stats
from packgraph.data.stream import DataStream, corpus_documents
from packgraph.graphs.recorder import stand_in
from packgraph.packing import pack_sequences
from packgraph.train import TrainConfig, Trainer, TrainResult, deterministic_kernels, resolve_device
from packgraph.train.logs import pyplot, text_table

__all__ = ["DEFAULTS", "demo_defaults", "run_demo", "compare_losses"]

Echo = Callable[[str], None]

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


@dataclass
class _Run:
    """One training run of the demo and what was measured on it."""

    name: str  # "eager", "graphed-layer", ...: its directory and demo.json key
    label: str  # as printed
    cfg: TrainConfig
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    result: TrainResult | None = None
    busy: Any = None  # bench_methods.KernelProfile of the profiled steps
    timed: bool = True  # a row of the step-time table (the control rerun is not)


# ---------------------------------------------------------------------------------------------- comparison
def compare_losses(reference: Sequence[float], other: Sequence[float]) -> dict[str, Any]:
    """How ``other``'s loss curve departs from ``reference``'s, over the steps both have (1-based steps).

    ``bitwise_equal``: every loss is the same float. ``max_abs_diff`` and ``max_diff_step``: the largest
    ``|other - reference|`` and where it is; ``first_diff_step``: the first step that differs (both ``None`` when
    equal).
    """
    pairs = list(zip(reference, other, strict=False))
    diffs = [abs(b - a) for a, b in pairs]
    unequal = [i for i, (a, b) in enumerate(pairs) if a != b]
    worst = max(range(len(diffs)), key=diffs.__getitem__, default=None)
    return {
        "steps": len(pairs),
        "bitwise_equal": not unequal and len(reference) == len(other),
        "max_abs_diff": max(diffs, default=0.0),
        "max_diff_step": worst + 1 if unequal and worst is not None else None,
        "first_diff_step": unequal[0] + 1 if unequal else None,
    }


def _difference_line(label: str, cmp: dict[str, Any], deterministic: bool, control: dict[str, Any] | None) -> str:
    if cmp["bitwise_equal"]:
        return f"{label} vs eager: bitwise equal losses over {cmp['steps']} steps"
    where = (
        f"largest |loss diff| {cmp['max_abs_diff']:.2e} at step {cmp['max_diff_step']} "
        f"(first difference at step {cmp['first_diff_step']})"
    )
    if deterministic:
        cause = (
            "deterministic kernels were on, so this is not kernel noise: it is a packgraph bug, please report it "
            "with demo.json"
        )
    elif control is None:
        cause = "cause: non-deterministic kernels (run without --fast for deterministic ones)"
    else:
        spread = "identical" if control["bitwise_equal"] else f"{control['max_abs_diff']:.2e} apart"
        cause = (
            "cause: non-deterministic kernels (FlashAttention's backward adds with atomics, bf16 training "
            f"amplifies it): two eager runs of the same config end up {spread}; run without --fast for "
            "deterministic kernels and bitwise equal runs"
        )
    return f"{label} vs eager: {where}; {cause}"


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
def _plan(cfg: TrainConfig, scopes: Sequence[str]) -> list[_Run]:
    out = Path(cfg.out_dir or ".")

    def run(name: str, label: str, graphs: bool, scope: str = cfg.scope, timed: bool = True) -> _Run:
        c = dataclasses.replace(cfg, graphs=graphs, scope=scope, out_dir=str(out / name), plot=False, progress=False)
        return _Run(name, label, c, timed=timed)

    runs = [run("eager", "eager", False)]
    runs += [run(f"graphed-{s}", f"graphed {s}", True, s) for s in scopes]
    if scopes and not cfg.deterministic:
        # The control: two eager runs' drift is what non-deterministic kernels alone do.
        runs.append(run("eager-rerun", "eager (rerun)", False, timed=False))
    return runs


def _train_all(
    runs: list[_Run],
    docs: Sequence[torch.Tensor],
    window_start: int,
    echo: Echo,
    profile: Callable[[Trainer], Any] | None = None,
) -> None:
    """Train every timed run to ``window_start``, and each control run to its end; then run the remaining steps of
    each under ``profile`` (which must step the trainer to its end and return a ``KernelProfile``), and finish it.
    """
    trainers: dict[str, Trainer] = {}
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
    from packgraph.bench_methods import gpu_busy_ms  # CUDA only: keeps torch._dynamo out of a CPU demo

    steps = trainer.cfg.steps - trainer.step_index
    return gpu_busy_ms(lambda _i: trainer.step(), steps=steps)


def _capture_steps(runs: Sequence[_Run]) -> set[int]:
    """0-based steps in which some run's capture count rose."""
    found = set()
    for run in runs:
        before = 0
        for i, row in enumerate(run.rows):
            if row["captures"] > before:
                found.add(i)
            before = row["captures"]
    return found


def _timed_steps(steps: int, window_start: int, captures: set[int]) -> list[int]:
    """The 0-based steps every run is timed over: after the warm-up, before the profiled ones, without captures."""
    warm = min(10, steps // 5)
    for first in (warm, 0):
        timed = [s for s in range(first, window_start) if s not in captures]
        if timed:
            return timed
    return list(range(steps))  # a degenerate tiny run: every step


# ---------------------------------------------------------------------------------------------- figures
def _figures(run: _Run, timed: Sequence[int], window: Sequence[int]) -> dict[str, Any]:
    rows, result = run.rows, run.result
    if result is None:
        raise RuntimeError(f"run {run.name} has not finished")
    losses = [r["loss"] for r in rows]
    n = max(1, min(5, len(losses) // 6))
    first, last = statistics.fmean(losses[:n]), statistics.fmean(losses[-n:])
    timed_rows = [rows[s] for s in timed]
    figures: dict[str, Any] = {
        "loss_mean_steps": n,
        "loss_first_mean": first,
        "loss_last_mean": last,
        "loss_drop": (first - last) / first,
        "final_loss": losses[-1],
        "step_ms": statistics.median(r["step_ms"] for r in timed_rows),
        "tokens_per_s": sum(r["tokens"] for r in timed_rows) / sum(r["step_ms"] for r in timed_rows) * 1e3,
        "first_step_s": result.first_step_s,
        "wall_s": result.wall_s,
        "graph_sets": result.num_graph_sets,
        "captures": rows[-1]["captures"],
        "gpu_busy_ms": None,
        "step_over_busy": None,
        "kernels_per_step": None,
    }
    if run.busy is not None and run.busy.busy_ms > 0:
        window_ms = statistics.fmean(rows[s]["step_ms"] for s in window)
        figures.update(
            gpu_busy_ms=run.busy.busy_ms, step_over_busy=window_ms / run.busy.busy_ms, kernels_per_step=run.busy.kernels
        )
    figures["losses"] = losses
    return figures


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _speed_table(runs: Sequence[_Run], methods: dict[str, dict[str, Any]]) -> str:
    rows = []
    for run in runs:
        if not run.timed:
            continue
        m = methods[run.name]
        rows.append(
            [
                run.label,
                _fmt(m["step_ms"], ".2f"),
                _fmt(m["speedup"], ".2f", "x"),
                _fmt(m["gpu_busy_ms"], ".2f"),
                _fmt(m["step_over_busy"], ".2f"),
                f"{m['tokens_per_s']:,.0f}",
                _fmt(m["first_step_s"], ".2f"),
                m["graph_sets"] if run.cfg.graphs else "-",
            ]
        )
    header = ["method", "step ms", "speedup", "GPU-busy ms", "step/busy", "tokens/s", "first step s", "graph sets"]
    return text_table(rows, header)


def _spans(steps: Sequence[int]) -> str:
    """1-based ranges of 0-based ``steps``: ``[10, 11, 12, 20]`` -> ``"11-13, 21"``."""
    spans: list[list[int]] = []
    for s in sorted(steps):
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(f"{a + 1}-{b + 1}" if b > a else f"{a + 1}" for a, b in spans)


# ---------------------------------------------------------------------------------------------- plot
def plot_demo(
    runs: Sequence[_Run], methods: dict[str, dict[str, Any]], verdict: str, out: Path, echo: Echo | None
) -> Path | None:
    """``demo.png``: every loss curve on one axis (left), median step time and GPU-busy time per method (right)."""
    plt = pyplot(echo)
    if plt is None:
        return None
    fig, (loss_ax, time_ax) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    # Thick and faint under dashed and dotted: curves that are equal bit for bit still show as several.
    styles = [dict(linewidth=3.0, alpha=0.55), dict(linewidth=1.4, linestyle="--"), dict(linewidth=1.2, linestyle=":")]
    timed = [r for r in runs if r.timed]
    colors = []
    for i, run in enumerate(timed):
        losses = methods[run.name]["losses"]
        (line,) = loss_ax.plot(range(1, len(losses) + 1), losses, label=run.label, **styles[min(i, len(styles) - 1)])
        colors.append(line.get_color())
    loss_ax.set(xlabel="step", ylabel="loss (mean CE per target token)", title=f"loss: {verdict}")
    loss_ax.grid(alpha=0.3)
    loss_ax.legend()
    xs = range(len(timed))
    bars = time_ax.bar(xs, [methods[r.name]["step_ms"] for r in timed], color=colors)
    for x, run in zip(xs, timed, strict=True):
        m = methods[run.name]
        if m["gpu_busy_ms"] is not None:
            time_ax.hlines(m["gpu_busy_ms"], x - 0.4, x + 0.4, colors="black", linewidth=2)
        note = f"{m['step_ms']:.1f} ms" + (f"\n{m['speedup']:.2f}x" if m["speedup"] is not None else "")
        time_ax.annotate(note, (x, m["step_ms"]), ha="center", va="bottom", fontsize=9)
    if any(methods[r.name]["gpu_busy_ms"] is not None for r in timed):
        time_ax.plot([], [], color="black", linewidth=2, label="GPU-busy per step")  # the legend entry
        time_ax.legend(loc="upper right")
    time_ax.set_xticks(list(xs), [r.label for r in timed])
    time_ax.set(ylabel="ms per training step (median)", title="step time per method")
    time_ax.set_ylim(0, max(b.get_height() for b in bars) * 1.25)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


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


def _timing(runs: list[_Run], cfg: TrainConfig, window_start: int, device: torch.device) -> dict[str, Any]:
    captures = _capture_steps(runs)
    timed = _timed_steps(cfg.steps, window_start, captures)
    profiled = list(range(window_start, cfg.steps)) if any(r.busy is not None for r in runs) else []
    return {
        "timer": "cuda-events" if device.type == "cuda" else "perf-counter",
        "timed_steps": [s + 1 for s in timed],
        "profiled_steps": [s + 1 for s in profiled],
        "capture_steps": sorted(s + 1 for s in captures),
        "_timed": timed,
        "_profiled": profiled,
    }


def _method_figures(runs: list[_Run], timing: dict[str, Any]) -> dict[str, dict[str, Any]]:
    methods = {r.name: _figures(r, timing["_timed"], timing["_profiled"]) for r in runs}
    eager = methods["eager"]
    for run in runs:
        m = methods[run.name]
        m["speedup"] = eager["step_ms"] / m["step_ms"] if run.timed else None
        if run.name != "eager":
            m["vs_eager"] = compare_losses(eager["losses"], m["losses"])
    return methods


def _report(cfg: TrainConfig, runs: list[_Run], methods: dict[str, Any], timing: dict[str, Any], echo: Echo) -> str:
    """Print the losses and speed sections; return the one-phrase loss verdict for the plot."""
    eager = methods["eager"]
    n = eager["loss_mean_steps"]
    over = f"mean of first/last {n} steps" if n > 1 else "first/last step"
    echo(
        f"\neager: loss {eager['loss_first_mean']:.3f} -> {eager['loss_last_mean']:.3f} ({over}; "
        f"-{eager['loss_drop']:.0%})"
    )
    control = methods.get("eager-rerun", {}).get("vs_eager")
    verdicts = []
    for run in runs[1:]:
        cmp = methods[run.name]["vs_eager"]
        echo(_difference_line(run.label, cmp, cfg.deterministic, control if run.timed else None))
        if run.timed:
            verdicts.append("bitwise equal" if cmp["bitwise_equal"] else f"max |diff| {cmp['max_abs_diff']:.1e}")
    timed, profiled = timing["_timed"], timing["_profiled"]
    clock = "CUDA events" if timing["timer"] == "cuda-events" else "wall clock"
    busy = f"; GPU-busy over steps {_spans(profiled)} (kernel time, torch.profiler)" if profiled else ""
    echo(f"\nstep time: median over the same {len(timed)} steps of every run ({_spans(timed)}; {clock}){busy}")
    echo(_speed_table(runs, methods))
    busy_note = "; step/busy: mean step over the profiled steps / their GPU-busy time" if profiled else ""
    echo(f"first step: wall time of step 1, captures included{busy_note}")
    if not verdicts:
        return "eager"
    return ", ".join(sorted(set(verdicts))) if len(set(verdicts)) == 1 else "; ".join(verdicts)


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
    cuda = device.type == "cuda"
    if scopes and not cuda and stand_in() is None:  # (a stand-in recorder: CPU tests of the graphed runs)
        raise ValueError("the graphed runs need CUDA; pass scopes=() for an eager-only demo on this device")
    out = Path(cfg.out_dir) if cfg.out_dir else Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
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
    timing = _timing(runs, cfg, min(window_start, cfg.steps), device)
    methods = _method_figures(runs, timing)
    verdict = _report(cfg, runs, methods, timing, echo)
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
