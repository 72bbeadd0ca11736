"""PNG plots of ``packgraph bench`` results (needs matplotlib, the ``plot`` extra; skipped without it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from packgraph.bench.report import METHOD_ORDER, record_key, sort_records

__all__ = ["have_matplotlib", "plot_attention", "plot_results", "plot_steps", "plot_tiles"]


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def plot_steps(records: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Grouped bars: step ms per method for each (T, mix) cell, one panel per model (log scale); a black tick
    marks packgraph's GPU-busy time, the limit. None when there is nothing to plot."""
    ok = [r for r in sort_records(records) if r["status"] == "ok" and r.get("step_ms")]
    if not ok:
        return None
    plt = _pyplot()
    models = list(dict.fromkeys(r["model"] for r in ok))
    methods = [m for m in METHOD_ORDER if any(r["method"] == m for r in ok)]
    fig, axes = plt.subplots(len(models), 1, figsize=(max(8, 1.6 * len(ok) / len(models)), 4 * len(models)))
    axes = [axes] if len(models) == 1 else list(axes)
    colors = {m: f"C{i % 10}" for i, m in enumerate(methods)}  # one color per method across panels
    for ax, model in zip(axes, models, strict=True):
        mine = [r for r in ok if r["model"] == model]
        cells = list(dict.fromkeys(record_key(r)[1:3] for r in mine))
        present = [m for m in methods if any(r["method"] == m for r in mine)]  # adjacent bars in every panel
        width = 0.8 / len(present)
        for j, method in enumerate(present):
            xs, ys = [], []
            for i, cell in enumerate(cells):
                r = next((r for r in mine if record_key(r)[1:] == (*cell, method)), None)
                if r is not None:
                    xs.append(i + (j - (len(present) - 1) / 2) * width)
                    ys.append(r["step_ms"])
                    if method == "packgraph" and r.get("gpu_busy_ms"):
                        ax.hlines(r["gpu_busy_ms"], xs[-1] - width / 2, xs[-1] + width / 2, colors="black")
            ax.bar(xs, ys, width, label=method, color=colors[method])
        ax.set_ylim(bottom=min(r["step_ms"] for r in mine) / 3)  # a log axis from the shortest bar hides it
        ax.legend(ncol=min(len(present), 4), fontsize="small")
        ax.set_xticks(range(len(cells)), [f"T={T}\n{mix}" for T, mix in cells])
        ax.set_yscale("log")
        ax.set_ylabel("step ms (fwd+bwd+AdamW)")
        ax.set_title(f"{model}: step time per method (black tick: packgraph GPU-busy)")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_attention(rows: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Attention fwd+bwd time ratio vs the static max_seqlen (as a multiple of the true max), one panel per
    (T, head_dim), colour by capacity / true count. None when there are no rows."""
    if not rows:
        return None
    plt = _pyplot()
    panels = sorted({(r["T"], r["head_dim"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (T, head_dim) in zip(axes[0], panels, strict=True):
        sel = [r for r in rows if (r["T"], r["head_dim"]) == (T, head_dim)]
        groups = {"capacity = count": [], "capacity <= 4x count": [], "capacity > 4x count": []}
        for r in sel:
            over = r["capacity"] / max(r["num_seqs"], 1)
            name = "capacity = count" if over == 1 else "capacity <= 4x count" if over <= 4 else "capacity > 4x count"
            groups[name].append((r["max_seqlen"] / max(r["true_max"], 1), r["ratio"]))
        for name, points in groups.items():
            if points:
                ax.scatter(*zip(*points, strict=True), s=10, alpha=0.6, label=name)
        ax.axhline(1.10, color="red", linewidth=0.8, linestyle="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("static max_seqlen / true max")
        ax.set_ylabel("fwd+bwd time / eager (true max, count)")
        ax.set_title(f"varlen attention, T={T}, head_dim={head_dim}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_tiles(rows: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """The tile study of ``bench --backends``: forward+backward ms of the document mask's kernel under each tile
    choice, one bar group per mix, one panel per head size, FA2 (``flash``) as a black line over its group. A
    choice that failed has no bar. None without rows or matplotlib."""
    timed = [r for r in rows if r.get("fwdbwd_ms") is not None]
    if not timed or not have_matplotlib():
        return None
    plt = _pyplot()
    head_dims = sorted({r["head_dim"] for r in timed})
    mixes = list(dict.fromkeys(r["mix"] for r in timed))
    names = list(dict.fromkeys(r["tiles"] for r in timed if r["backend"] != "flash"))
    fig, axes = plt.subplots(1, len(head_dims), figsize=(6 * len(head_dims), 4.5), squeeze=False)
    width = 0.8 / max(len(names), 1)
    for ax, head_dim in zip(axes[0], head_dims, strict=True):
        ms = {(r["mix"], r["tiles"], r["backend"]): r["fwdbwd_ms"] for r in timed if r["head_dim"] == head_dim}
        for k, name in enumerate(names):
            xs = [i - 0.4 + (k + 0.5) * width for i, mix in enumerate(mixes) if (mix, name, "doc_mask-kernel") in ms]
            ys = [ms[(mix, name, "doc_mask-kernel")] for mix in mixes if (mix, name, "doc_mask-kernel") in ms]
            ax.bar(xs, ys, width=width, label=name)
        for i, mix in enumerate(mixes):
            if (mix, "-", "flash") in ms:
                ax.hlines(ms[(mix, "-", "flash")], i - 0.45, i + 0.45, colors="black", linewidth=1.5)
        T = timed[0]["T"]
        ax.set_xticks(range(len(mixes)), mixes)
        ax.set_ylabel("forward+backward ms")
        ax.set_title(f"document mask, T={T}, head size {head_dim} (black: FA2)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][-1].legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_results(doc: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """Write ``step_ms.png`` and ``attention.png`` (when there is data) into ``out_dir``; [] without matplotlib."""
    if not have_matplotlib():
        return []
    written = [
        plot_steps(doc.get("records", []), out_dir / "step_ms.png"),
        plot_attention(doc.get("attention", []), out_dir / "attention.png"),
    ]
    return [p for p in written if p is not None]
