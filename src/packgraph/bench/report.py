"""Tables of ``packgraph bench`` results (pure Python: no torch, no device).

The results document (``results.json``) holds ``machine``, ``runs``, ``streams``, ``records`` (one per
model x T x mix x method), ``attention`` (micro-benchmark rows) and ``attention_summary``. Everything here reads
that document, so ``results.md`` and the README table can be regenerated from committed results. The benchmark's
goals (met / not met) are judged apart, by :mod:`packgraph.bench.targets`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = [
    "LOSS_TOLERANCE",
    "METHOD_ORDER",
    "RECORD_FIELDS",
    "TABLE_COLUMNS",
    "attention_table",
    "busy_delta",
    "cell_label",
    "compare_table",
    "derive",
    "kernel_class_table",
    "load_results",
    "readme_table",
    "markdown_table",
    "record_key",
    "results_markdown",
    "results_table",
    "sort_records",
    "write_table",
]

RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "T": (int,),
    "mix": (str,),
    "method": (str,),
    "status": (str,),
    "error": (str, type(None)),
    "device": (str,),
    "timer": (str, type(None)),
    "steps": (int,),
    "step_ms": (float, type(None)),
    "step_ms_p10": (float, type(None)),
    "step_ms_p90": (float, type(None)),
    "real_tokens_per_step": (float, type(None)),
    "tokens_per_s": (float, type(None)),
    "speedup_vs_eager": (float, type(None)),
    "gpu_busy_ms": (float, type(None)),
    "gpu_copy_ms": (float, type(None)),
    "kernels_per_step": (float, type(None)),
    "busy_steps": (int, type(None)),
    "step_ms_busy_batches": (float, type(None)),
    "gpu_busy_by_class": (dict, type(None)),
    "top_kernels": (list, type(None)),
    "step_over_busy": (float, type(None)),
    "first_step_s": (float, type(None)),
    "first_loss": (float, type(None)),
    "first_loss_vs_eager": (float, type(None)),
    "graphs": (int, type(None)),
    "graph_batches": (int, type(None)),
    "predicted_graphs": (int, type(None)),
    "recompiles": (int, type(None)),
    "peak_mem_mib": (float, type(None)),
    "peak_mem_timed_mib": (float, type(None)),
    "peak_reserved_mib": (float, type(None)),
    "peak_requested_mib": (float, type(None)),
    "elapsed_s": (float, type(None)),
    "extra": (dict,),
    "run": (int,),
}
"""Every key of a record and the JSON types its value may have."""

TABLE_COLUMNS: tuple[str, ...] = (
    "model",
    "T",
    "mix",
    "method",
    "step ms",
    "tok/s",
    "x eager",
    "GPU-busy ms",
    "step/busy",
    "first step s",
    "graphs",
    "recompiles",
    "peak MiB",
    "status",
)

LOSS_TOLERANCE = 0.02
"""Relative first-loss difference vs eager above which results.md flags a method (bf16 noise is far below)."""

_MODEL_ORDER = ("tiny", "small", "medium", "large")
_MIX_ORDER = ("corpus", "short", "long")
METHOD_ORDER: tuple[str, ...] = (
    "eager",
    "packgraph",
    "packgraph-model",
    "packgraph+compile",
    "packgraph-model+compile",
    "packgraph-docmask",
    "packgraph-docmask-model+compile",
    "compile",
    "compile-ro",
    "compile-ro-raw",
    "padded",
    "padded-mask",
)
"""The order of methods in every table and plot (columns of the README table)."""


def _order(value: str, order: Sequence[str]) -> tuple[int, str]:
    return (order.index(value) if value in order else len(order), value)


def cell_label(r: Mapping[str, Any]) -> str:
    """A record's cell as text: ``"small T=2048 corpus"``."""
    return f"{r['model']} T={r['T']} {r['mix']}"


def record_key(r: Mapping[str, Any]) -> tuple:
    """The identity of a record: ``(model, T, mix, method)``; a later run replaces a record with the same key."""
    return r["model"], r["T"], r["mix"], r["method"]


def sort_records(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Records in table order: model size, T, mix, method."""
    return sorted(
        records,
        key=lambda r: (
            _order(r["model"], _MODEL_ORDER),
            r["T"],
            _order(r["mix"], _MIX_ORDER),
            _order(r["method"], METHOD_ORDER),
        ),
    )


def load_results(results: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    """A results document from a ``results.json`` path (or its directory), or the document itself."""
    if isinstance(results, Mapping):
        return results
    path = Path(results)
    if path.is_dir():
        path = path / "results.json"
    return json.loads(path.read_text())


def derive(records: list[dict[str, Any]]) -> None:
    """Fill the derived figures in place: tokens/s, speedup vs the same cell's eager record, step/busy."""
    eager = {record_key(r)[:3]: r for r in records if r["method"] == "eager" and r["status"] == "ok"}
    for r in records:
        step = r.get("step_ms")
        ok = r["status"] == "ok" and step
        r["tokens_per_s"] = r["real_tokens_per_step"] / (step / 1e3) if ok and r.get("real_tokens_per_step") else None
        base = eager.get(record_key(r)[:3])
        r["speedup_vs_eager"] = base["step_ms"] / step if ok and base is not None else None
        # step/busy over the same batches: the profiled ones (their mean timed step) when the record has them
        busy, busy_step = r.get("gpu_busy_ms"), r.get("step_ms_busy_batches") or step
        r["step_over_busy"] = busy_step / busy if ok and busy else None
        # every method starts from the same weights and batch: its first loss must be eager's (bf16 noise aside)
        loss, ref = r.get("first_loss"), base.get("first_loss") if base is not None else None
        r["first_loss_vs_eager"] = abs(loss - ref) / max(abs(ref), 1e-12) if ok and loss is not None and ref else None


# ---------------------------------------------------------------------------------------------- tables
def _fmt(value: Any, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return format(value, spec)
    return str(value)


def _row(r: Mapping[str, Any]) -> list[str]:
    graphs = _fmt(r.get("graphs"))
    if r.get("graphs") is not None and r.get("graph_batches"):
        graphs += f" / {r['graph_batches']}"
    status = r["status"] if r["status"] == "ok" else f"{r['status']}: {(r.get('error') or '')[:80]}"
    return [
        r["model"],
        str(r["T"]),
        r["mix"],
        r["method"],
        _fmt(r.get("step_ms"), ".2f"),
        _fmt(r.get("tokens_per_s"), ".3g"),
        _fmt(r.get("speedup_vs_eager"), ".2f"),
        _fmt(r.get("gpu_busy_ms"), ".2f"),
        _fmt(r.get("step_over_busy"), ".2f"),
        _fmt(r.get("first_step_s"), ".2f"),
        graphs,
        _fmt(r.get("recompiles")),
        _fmt(r.get("peak_mem_mib"), ".0f"),
        status.replace("|", "/").replace("\n", " "),
    ]


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table of ``header`` and ``rows`` (cells formatted with ``str``), without a trailing newline."""
    rows = [[str(c) for c in row] for row in rows]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def results_table(records: Iterable[Mapping[str, Any]]) -> str:
    """The main Markdown table: one row per record, :data:`TABLE_COLUMNS`."""
    return markdown_table(TABLE_COLUMNS, (_row(r) for r in sort_records(records)))


def _spread_verdict(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    # Two medians differ beyond noise when their runs' 10-90% step ranges do not overlap; without both ranges
    # nothing is judged.
    b_lo, b_hi, a_lo, a_hi = (r.get(k) for r in (before, after) for k in ("step_ms_p10", "step_ms_p90"))
    if None in (b_lo, b_hi, a_lo, a_hi):
        return "no range"
    if a_lo > b_hi:
        return "slower"
    if a_hi < b_lo:
        return "faster"
    return "within noise"


def compare_table(before: str | Path | Mapping[str, Any], after: str | Path | Mapping[str, Any]) -> str:
    """Two results documents cell by cell (the records of both): step ms (median, and its 10-90% range), GPU-busy,
    peak allocated, graphs and recompiles, before -> after. A step is ``slower``/``faster`` only when the two runs'
    10-90% ranges do not overlap; records of one document only are listed with a dash for the other."""
    old = {record_key(r): r for r in load_results(before)["records"] if r["status"] == "ok"}
    new = {record_key(r): r for r in load_results(after)["records"] if r["status"] == "ok"}
    rows = []
    for r in sort_records([*old.values(), *(r for k, r in new.items() if k not in old)]):
        b, a = old.get(record_key(r)), new.get(record_key(r))

        def pair(field: str, spec: str, b=b, a=a) -> str:
            return f"{_fmt(b and b.get(field), spec)} -> {_fmt(a and a.get(field), spec)}"

        ratio = _fmt(a["step_ms"] / b["step_ms"], ".3f") if a and b else "-"
        rows.append(
            [
                cell_label(r),
                r["method"],
                pair("step_ms", ".2f"),
                ratio,
                _spread_verdict(b, a) if a and b else "-",
                pair("gpu_busy_ms", ".2f"),
                pair("peak_mem_mib", ".0f"),
                pair("graphs", ""),
                pair("recompiles", ""),
            ]
        )
    header = ["cell", "method", "step ms", "after/before", "step", "GPU-busy ms", "peak MiB", "graphs", "recompiles"]
    return markdown_table(header, rows)


def attention_table(summary: Iterable[Mapping[str, Any]]) -> str:
    """Markdown table of :func:`packgraph.bench.attention.evaluate_ladders` output."""
    header = ("T", "ladder", "buckets", "worst ratio", "mean ratio", "worst by mix", "packings", "missing")
    rows = []
    for s in sorted(summary, key=lambda s: (s["T"], s["buckets"], s["ladder"])):
        by_mix = ", ".join(f"{m} {v:.2f}" for m, v in sorted(s["worst_ratio_by_mix"].items()))
        rows.append(
            (
                str(s["T"]),
                s["ladder"],
                str(s["buckets"]),
                _fmt(s["worst_ratio"], ".2f"),
                _fmt(s["mean_ratio"], ".2f"),
                by_mix or "-",
                str(s["packings"]),
                str(s["missing"]),
            )
        )
    return markdown_table(header, rows)


def kernel_class_table(records: Iterable[Mapping[str, Any]]) -> str:
    """Markdown table: each profiled record's kernel time per step split by kernel class (see
    ``packgraph.bench.profiling.KERNEL_CLASSES``), memcpy/memset included as their own class."""
    profiled = [r for r in sort_records(records) if r.get("gpu_busy_by_class")]
    totals: dict[str, float] = {}
    for r in profiled:
        for cls, ms in r["gpu_busy_by_class"].items():
            totals[cls] = totals.get(cls, 0.0) + ms
    classes = sorted(totals, key=lambda c: -totals[c])
    header = ("model", "T", "mix", "method", "steps", "kernels/step", *classes)
    rows = [
        (
            r["model"],
            str(r["T"]),
            r["mix"],
            r["method"],
            _fmt(r.get("busy_steps")),
            _fmt(r.get("kernels_per_step"), ".0f"),
            *(_fmt(r["gpu_busy_by_class"].get(c), ".3f") for c in classes),
        )
        for r in profiled
    ]
    return markdown_table(header, rows)


def busy_delta(record: Mapping[str, Any], base: Mapping[str, Any], top: int = 3) -> str:
    """The kernel classes that differ most between two records' GPU-busy splits, e.g.
    ``"gemm +0.21, attention fwd +0.05, elementwise -0.02 ms"`` (empty without splits)."""
    a, b = record.get("gpu_busy_by_class") or {}, base.get("gpu_busy_by_class") or {}
    if not a or not b:
        return ""
    delta = {c: a.get(c, 0.0) - b.get(c, 0.0) for c in set(a) | set(b) if c != "memcpy/memset"}
    biggest = sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:top]
    return ", ".join(f"{c} {d:+.3f}" for c, d in biggest) + " ms"


def _machine_line(doc: Mapping[str, Any]) -> str:
    m = doc.get("machine") or {}
    where = f"{m['gpu']} (driver {m.get('driver') or '?'})" if m.get("gpu") else f"CPU {m.get('cpu', '?')}"
    return (
        f"{where}, torch {m.get('torch', '?')} (CUDA {m.get('cuda') or '-'}), triton {m.get('triton') or '-'}, "
        f"Python {m.get('python', '?')}, {m.get('date', '?')}"
    )


def results_markdown(doc: Mapping[str, Any]) -> str:
    """The whole ``results.md``: machine, the main table, stream statistics, attention ladders, loss sanity."""
    parts = [
        "# packgraph bench results",
        "",
        f"Machine: {_machine_line(doc)}",
        "",
        "Runs: " + "; ".join("`packgraph bench " + " ".join(run.get("argv", [])) + "`" for run in doc.get("runs", [])),
        "",
        "Step ms: median of the timed steps (full training step: fwd, bwd, AdamW). GPU-busy: summed kernel "
        "durations per step (torch.profiler) over the first batches of the timed pool; step/busy divides the mean "
        "timed step of those same batches by it. graphs: recorded over the batches shown.",
        "",
        "## Steps",
        "",
        results_table(doc.get("records", [])),
    ]
    streams = doc.get("streams", [])
    if streams:
        header = ("T", "mix", "batches", "docs/batch", "mean max_seqlen", "real tokens", "buckets", "exact sigs")
        rows = [
            (
                str(s["T"]),
                s["mix"],
                str(s["batches"]),
                f"{s['docs_per_batch']:.1f}",
                f"{s['max_seqlen_mean']:.0f}",
                f"{s['real_token_fraction']:.3f}",
                str(s["distinct_buckets"]),
                str(s["distinct_exact_signatures"]),
            )
            for s in sorted(streams, key=lambda s: (s["T"], _order(s["mix"], _MIX_ORDER)))
        ]
        parts += ["", "## Streams", "", markdown_table(header, rows)]
    if doc.get("attention_summary"):
        parts += [
            "",
            "## Attention: bucket ladders (time vs eager's true max_seqlen and count)",
            "",
            attention_table(doc["attention_summary"]),
        ]
        for T, rec in sorted((doc.get("attention_recommendation") or {}).items(), key=lambda kv: int(kv[0])):
            parts.append("")
            if rec is None:
                parts.append(f"T={T}: no candidate ladder stays within the limit.")
            else:
                parts.append(
                    f"T={T}: recommended max_seqlen ladder {rec['max_seqlen_ladder']}, capacity ladder "
                    f"{rec['capacity_ladder']} ({rec['buckets']} buckets, worst {rec['worst_ratio']:.3f}x)."
                )
    if any(r.get("gpu_busy_by_class") for r in doc.get("records", [])):
        parts += ["", "## GPU-busy by kernel class (ms per step)", "", kernel_class_table(doc["records"])]
    suspects = [
        r for r in sort_records(doc.get("records", [])) if (r.get("first_loss_vs_eager") or 0.0) > LOSS_TOLERANCE
    ]
    parts += ["", "## Sanity: first-step loss vs eager (same weights, same batch)", ""]
    if suspects:
        parts += [
            f"- {cell_label(r)} {r['method']}: loss {r['first_loss']:.5g}, {r['first_loss_vs_eager']:.2%} off eager"
            for r in suspects
        ]
    else:
        parts.append(f"Every method's first loss is within {LOSS_TOLERANCE:.0%} of eager's.")
    parts.append("")
    return "\n".join(parts)


def readme_table(results_json: str | Path | Mapping[str, Any]) -> str:
    """The README's main table from a results document: one row per (model, T, mix), one column per method,
    each cell ``step ms (speedup vs eager)``, plus packgraph's step/GPU-busy ratio."""
    doc = load_results(results_json)
    records = [r for r in doc.get("records", []) if r["status"] == "ok"]
    methods = [m for m in METHOD_ORDER if any(r["method"] == m for r in records)]
    cells: dict[tuple, dict[str, Mapping[str, Any]]] = {}
    for r in sort_records(records):
        cells.setdefault(record_key(r)[:3], {})[r["method"]] = r
    header = ["model", "T", "mix", *methods, "packgraph step/busy", "packgraph memory / eager"]
    rows = []
    for (model, T, mix), by_method in cells.items():
        row = [model, str(T), mix]
        for m in methods:
            r = by_method.get(m)
            if r is None:
                row.append("-")
            elif m == "eager" or r.get("speedup_vs_eager") is None:
                row.append(f"{r['step_ms']:.2f} ms")
            else:
                row.append(f"{r['step_ms']:.2f} ms ({r['speedup_vs_eager']:.2f}x)")
        pg, eager = by_method.get("packgraph"), by_method.get("eager")
        row.append(_fmt(pg.get("step_over_busy") if pg else None, ".2f"))
        row.append(_memory_ratios(pg, eager))
        rows.append(row)
    caption = (
        "Step time per training step (fwd+bwd+AdamW), speedup vs eager in brackets; packgraph's peak memory over "
        "eager's (allocated / reserved): eager's over its timed batches, packgraph's over the same batches and the "
        f"rest of its graph-count batches, captures included. {_machine_line(doc)}."
    )
    return caption + "\n\n" + markdown_table(header, rows)


def _memory_ratios(pg: Mapping[str, Any] | None, eager: Mapping[str, Any] | None) -> str:
    if not pg or not eager or not pg.get("peak_mem_mib") or not eager.get("peak_mem_mib"):
        return "-"
    # Three decimals on allocated: its target is 1.00x, and a miss of a few MiB in a GiB is 1.00 at two.
    alloc = pg["peak_mem_mib"] / eager["peak_mem_mib"]
    if pg.get("peak_reserved_mib") and eager.get("peak_reserved_mib"):
        return f"{alloc:.3f} / {pg['peak_reserved_mib'] / eager['peak_reserved_mib']:.2f}"
    return f"{alloc:.3f} / -"


def write_table(out_dir: str | Path, stem: str, table: str, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    """Write ``<stem>.md`` (``table``) and ``<stem>.json`` (``meta`` and ``rows``) under ``out_dir``, made if
    missing: how the scripts of ``bench/`` keep what they print. ``meta`` gets the UTC date."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), **meta}
    (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (out / f"{stem}.md").write_text(table + "\n")
