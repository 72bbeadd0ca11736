"""The figures, text and plot of ``packgraph demo`` (:mod:`packgraph.train.demo`), from its finished runs.

Each run's figures come from its own log rows: its loss curve and how it departs from eager's
(:func:`compare_losses`), and its step time over the steps every run is timed on (:func:`step_timing`).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from packgraph.train.config import TrainConfig
from packgraph.train.logs import largest, pyplot, text_table
from packgraph.train.trainer import TrainResult

__all__ = ["DemoRun", "compare_losses", "step_timing", "method_figures", "print_report", "plot_demo"]

Echo = Callable[[str], None]


@dataclass
class DemoRun:
    """One training run of the demo and what was measured on it."""

    name: str  # "eager", "graphed-layer", ...: its directory and demo.json key
    label: str  # as printed
    cfg: TrainConfig
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    result: TrainResult | None = None
    busy: Any = None  # bench.profiling.KernelProfile of the profiled steps
    timed: bool = True  # a row of the step-time table (the control rerun is not)


# ---------------------------------------------------------------------------------------------- comparison
def compare_losses(reference: Sequence[float], other: Sequence[float]) -> dict[str, Any]:
    """How ``other``'s loss curve departs from ``reference``'s, over the steps both have (1-based steps).

    ``bitwise_equal``: every loss is the same float. ``max_abs_diff`` and ``max_diff_step``: the largest
    ``|other - reference|`` and where it is (a NaN, from a diverged run, counts as the largest);
    ``first_diff_step``: the first step that differs (both ``None`` when equal).
    """
    pairs = list(zip(reference, other, strict=False))
    diffs = [abs(b - a) for a, b in pairs]
    unequal = [i for i, (a, b) in enumerate(pairs) if a != b]
    biggest, worst = largest(diffs)
    return {
        "steps": len(pairs),
        "bitwise_equal": not unequal and len(reference) == len(other),
        "max_abs_diff": biggest,
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


# ---------------------------------------------------------------------------------------------- timing
def _capture_steps(runs: Sequence[DemoRun]) -> set[int]:
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


def step_timing(runs: list[DemoRun], cfg: TrainConfig, window_start: int, device: torch.device) -> dict[str, Any]:
    """The steps the runs are timed, profiled and captured in (1-based lists, as ``demo.json`` holds them; 0-based
    under ``_timed`` and ``_profiled``). Timed: after the warm-up and before ``window_start`` (where profiling
    starts), leaving out each step in which some run captured graphs."""
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


# ---------------------------------------------------------------------------------------------- figures
def _figures(run: DemoRun, timed: Sequence[int], window: Sequence[int]) -> dict[str, Any]:
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


def method_figures(runs: list[DemoRun], timing: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each finished run's figures, by name (``demo.json``'s ``methods``), over the steps of :func:`step_timing`:
    with ``speedup`` over eager (timed runs) and ``vs_eager`` (:func:`compare_losses`, every run but eager)."""
    methods = {r.name: _figures(r, timing["_timed"], timing["_profiled"]) for r in runs}
    eager = methods["eager"]
    for run in runs:
        m = methods[run.name]
        m["speedup"] = eager["step_ms"] / m["step_ms"] if run.timed else None
        if run.name != "eager":
            m["vs_eager"] = compare_losses(eager["losses"], m["losses"])
    return methods


# ---------------------------------------------------------------------------------------------- text
def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _speed_table(runs: Sequence[DemoRun], methods: dict[str, dict[str, Any]]) -> str:
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


def print_report(
    cfg: TrainConfig, runs: list[DemoRun], methods: dict[str, Any], timing: dict[str, Any], echo: Echo
) -> str:
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


# ---------------------------------------------------------------------------------------------- plot
def plot_demo(
    runs: Sequence[DemoRun], methods: dict[str, dict[str, Any]], verdict: str, out: Path, echo: Echo | None
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
