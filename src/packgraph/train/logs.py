"""Run logs: reading ``train.jsonl``, smoothing, throughput, convergence comparison, text tables and loss plots;
:func:`atomic_open`, which the run's other files are written through too.

A log is a list of rows, one per optimizer step, as :func:`packgraph.train.train` writes them: at least
``step`` (1-based) and ``loss``; ``tokens``, ``step_ms`` and ``captures`` feed :func:`throughput` when present.
Everything here is pure Python over those rows (no torch); plotting needs matplotlib (``packgraph[plot]``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_open",
    "write_text_atomically",
    "largest",
    "read_log",
    "truncate_log",
    "ema",
    "throughput",
    "convergence_report",
    "plot_losses",
    "pyplot",
    "text_table",
]


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[Any]:
    """A file to write ``path``'s new content to, put in place only once all of it is on disk.

    The block writes to ``<name>.tmp`` beside ``path``. When it ends, the file is flushed, fsynced and renamed over
    ``path`` (``os.replace``: readers see the old file or the new one, never a part); when it raises, the temporary
    file is deleted and ``path`` is left as it was. A process killed mid-write leaves ``path`` intact and may leave
    the ``.tmp`` file, which the next write of ``path`` replaces.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX); skipped where directories cannot be opened (Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """``Path(path).write_text(text)`` through :func:`atomic_open`: a crash leaves the old file or the new one."""
    with atomic_open(path, "w") as f:
        f.write(text)


def throughput(rows: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """``(steady, overall)`` real tokens per second of logged steps.

    Steady leaves out the first ``min(10, n // 5)`` steps (allocator and kernel warm-up) and every later step
    that captured graphs (its ``captures`` count rose): capture is a one-off cost per bucket, not the training
    rate. The first row has no predecessor to compare with, so with fewer than 5 rows it always counts.
    Overall counts every step.
    """

    def rate(selected: Sequence[dict[str, Any]]) -> float:
        secs = sum(r.get("step_ms", 0.0) for r in selected) / 1e3
        return sum(r.get("tokens", 0) for r in selected) / secs if secs > 0 else float("nan")

    skip = min(10, len(rows) // 5)
    steady = [
        r
        for i, r in enumerate(rows)
        if i >= skip and (i == 0 or r.get("captures", 0) == rows[i - 1].get("captures", 0))
    ]
    return rate(steady or rows), rate(rows)


def largest(values: Sequence[float]) -> tuple[float, int | None]:
    """``(the largest value, its index)``; a NaN counts as the largest (the first one), so a diverged run never
    reads as a small difference. ``(0.0, None)`` when empty. Python's ``max`` keeps whatever precedes a NaN."""
    for i, v in enumerate(values):
        if math.isnan(v):
            return v, i
    if not values:
        return 0.0, None
    i = max(range(len(values)), key=values.__getitem__)
    return values[i], i


def read_log(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a ``train.jsonl``. ``FileNotFoundError`` / ``ValueError`` (with the line) when unreadable."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no log file at {path}")
    rows = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from e
        if not isinstance(row, dict) or "step" not in row or "loss" not in row:
            raise ValueError(f"{path}:{i}: a train log row needs 'step' and 'loss'")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no steps logged")
    return rows


def truncate_log(path: Path, last_step: int) -> None:
    """Drop logged steps after ``last_step``, so a resumed run does not log them twice."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    write_text_atomically(path, "".join(line + "\n" for line in keep))  # a kill here must not lose the log


def ema(values: Sequence[float], beta: float = 0.95) -> list[float]:
    """Bias-corrected exponential moving average: ``m_t = beta m_{t-1} + (1 - beta) x_t``, reported
    ``m_t / (1 - beta^t)`` so the start is not pulled toward 0."""
    out, m = [], 0.0
    for t, x in enumerate(values, 1):
        m = beta * m + (1 - beta) * x
        out.append(m / (1 - beta**t))
    return out


def convergence_report(logs: dict[str, Sequence[dict[str, Any]]], beta: float = 0.95) -> dict[str, Any]:
    """Compare runs' smoothed losses against the first run, over the steps they share.

    Returns ``{"reference", "common_steps", "max_rel_diff": {run: max_t |ema_run - ema_ref| / ema_ref},
    "final_loss": {run: last loss}, "first_loss": {run: first loss}, "tokens_per_s": {run: ...}}``.
    ``tokens_per_s`` / ``tokens_per_s_overall`` are :func:`throughput`'s steady and overall rates.
    """
    names = list(logs)
    if not names:
        raise ValueError("no runs to compare")
    by_step = {n: {int(r["step"]): float(r["loss"]) for r in rows} for n, rows in logs.items()}
    common = sorted(set.intersection(*(set(s) for s in by_step.values())))
    if not common:
        raise ValueError("the runs share no step")
    smooth = {n: ema([by_step[n][s] for s in common], beta) for n in names}
    ref = names[0]
    max_rel = {
        n: largest([abs(a - b) / abs(b) for a, b in zip(smooth[n], smooth[ref], strict=True)])[0] for n in names[1:]
    }
    rates = {n: throughput(rows) for n, rows in logs.items()}
    return {
        "reference": ref,
        "common_steps": len(common),
        "ema_beta": beta,
        "max_rel_diff": max_rel,
        "first_loss": {n: by_step[n][common[0]] for n in names},
        "final_loss": {n: by_step[n][common[-1]] for n in names},
        "tokens_per_s": {n: r[0] for n, r in rates.items()},
        "tokens_per_s_overall": {n: r[1] for n, r in rates.items()},
    }


def text_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """``rows`` under ``header``, every column right-aligned to its widest cell, a dashed rule under the header."""
    cells = [[str(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def pyplot(echo: Callable[[str], None] | None = print) -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or ``None`` with a one-line note when matplotlib is not
    installed (``pip install packgraph[plot]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if echo:
            echo("plot skipped: matplotlib is not installed (pip install 'packgraph[plot]')")
        return None
    return plt


def plot_losses(
    curves: dict[str, Sequence[tuple[int, float]]],
    out: str | os.PathLike,
    echo: Callable[[str], None] | None = print,
    beta: float = 0.95,
) -> Path | None:
    """Plot ``{label: [(step, loss), ...]}`` (raw, faint, and EMA-smoothed) on one PNG.

    Returns the path, or ``None`` with a one-line note when matplotlib is not installed (see :func:`pyplot`).
    """
    plt = pyplot(echo)
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, points in curves.items():
        steps = [s for s, _ in points]
        values = [v for _, v in points]
        (line,) = ax.plot(steps, ema(values, beta), label=f"{label} (EMA {beta})")
        ax.plot(steps, values, color=line.get_color(), alpha=0.25, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean CE per target token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_open(out) as f:
            fig.savefig(f, dpi=120, format=out.suffix.lstrip(".").lower() or "png")
    finally:
        plt.close(fig)
    return out
