"""The benchmark issue's goals, evaluated on ``packgraph bench`` results: each target met, not met or not measured.

``scripts/readme-results`` writes the verdicts into README.md; ``scripts/gpu-check`` runs this after its benchmark:

    python3 -m packgraph.bench.targets RESULTS_JSON [RESULTS_JSON ...] [--report FILE]

prints one line per target and file; ``--report`` also appends the verdicts to a gpu-check report (JSON lines).
``packgraph bench`` itself writes no verdict: a results file keeps its measurements, and the goals of the day
judge it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from packgraph.bench.report import busy_delta, cell_label, load_results, record_key

GRAPHED = (
    "packgraph",
    "packgraph-model",
    "packgraph+compile",
    "packgraph-model+compile",
    "packgraph-docmask",
    "packgraph-docmask-model+compile",
)
"""The methods that replay packgraph's graphs: the ones the step, graph and memory targets are about."""

Cells = Mapping[tuple, Mapping[str, Mapping[str, Any]]]
"""The ``ok`` records by cell ``(model, T, mix)``, then by method."""


def _ok(records: Iterable[Mapping[str, Any]], **match: Any) -> list[Mapping[str, Any]]:
    return [r for r in records if r["status"] == "ok" and all(r[k] == v for k, v in match.items())]


def _verdict(name: str, checks: list[tuple[bool, str]]) -> dict[str, Any]:
    if not checks:
        return {"target": name, "met": None, "detail": "not measured"}
    return {"target": name, "met": all(ok for ok, _ in checks), "detail": "; ".join(d for _, d in checks)}


def _by_cell(records: Iterable[Mapping[str, Any]]) -> dict[tuple, dict[str, Mapping[str, Any]]]:
    by_cell: dict[tuple, dict[str, Mapping[str, Any]]] = {}
    for r in records:
        if r["status"] == "ok":
            by_cell.setdefault(record_key(r)[:3], {})[r["method"]] = r
    return by_cell


def _packgraph_vs_eager(by_cell: Cells, field: str) -> Iterator[tuple[Mapping[str, Any], Mapping[str, Any], float]]:
    """``(packgraph record, eager record, packgraph / eager)`` of ``field``, for each cell where both have it."""
    for m in by_cell.values():
        pg, eager = m.get("packgraph"), m.get("eager")
        if pg and eager and pg.get(field) and eager.get(field):
            yield pg, eager, pg[field] / eager[field]


def _step_over_busy(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for method, limit in (("packgraph", 1.15), ("packgraph-model", 1.05)):
        checks = []
        for r in _ok(records, model="small", method=method):
            if r["T"] <= 4096 and r.get("step_over_busy"):
                ratio = r["step_over_busy"]
                checks.append(
                    (ratio <= limit, f"{cell_label(r)}: {r['step_ms']:.2f} / {r['gpu_busy_ms']:.2f} ms = {ratio:.2f}x")
                )
        out.append(_verdict(f"small, T<=4096: {method} step <= {limit}x GPU-busy", checks))
    return out


def _gpu_busy(by_cell: Cells) -> dict[str, Any]:
    checks = []
    for pg, eager, ratio in _packgraph_vs_eager(by_cell, "gpu_busy_ms"):
        detail = f"{cell_label(pg)}: busy {pg['gpu_busy_ms']:.2f} / {eager['gpu_busy_ms']:.2f} ms = {ratio:.3f}x eager"
        why = busy_delta(pg, eager)
        checks.append((ratio <= 1.02, detail + (f" ({why})" if why else "")))
    return _verdict("GPU-busy under default buckets <= 1.02x eager's (true max_seqlen)", checks)


def _attention(doc: Mapping[str, Any]) -> dict[str, Any]:
    checks = []
    for s in doc.get("attention_summary", []):
        if s["ladder"] == "default":
            for mix, worst in sorted(s["worst_ratio_by_mix"].items()):
                checks.append((worst <= 1.10, f"T={s['T']} {mix}: worst {worst:.3f}x"))
    return _verdict("attention under default buckets <= 1.10x eager true-max time, every mix", checks)


def _versus_compile_ro(by_cell: Cells) -> list[dict[str, Any]]:
    """The steady-step, first-step and graph-count targets, against compile reduce-overhead in the same cell."""
    checks_step, checks_first, checks_graphs = [], [], []
    for m in by_cell.values():
        ro = m.get("compile-ro")
        graphed = [m[k] for k in GRAPHED if k in m]
        if ro and graphed:
            best = min(graphed, key=lambda r: r["step_ms"])
            checks_step.append(
                (
                    best["step_ms"] <= ro["step_ms"],
                    f"{cell_label(ro)}: {best['method']} {best['step_ms']:.2f} vs {ro['step_ms']:.2f} ms",
                )
            )
        pg = m.get("packgraph")
        if ro and pg and ro.get("first_step_s") and pg.get("first_step_s"):
            ratio = ro["first_step_s"] / pg["first_step_s"]
            detail = f"{cell_label(pg)}: {pg['first_step_s']:.2f} vs {ro['first_step_s']:.2f} s ({ratio:.1f}x)"
            checks_first.append((ratio >= 10, detail))
        if pg and pg.get("graphs") is not None:
            raw = m.get("compile-ro-raw")
            versus = f"; compile-ro-raw {raw['graphs']} / {raw['graph_batches']}" if raw and raw.get("graphs") else ""
            checks_graphs.append(
                (pg["graphs"] <= 8, f"{cell_label(pg)}: {pg['graphs']} over {pg['graph_batches']} batches{versus}")
            )
    return [
        _verdict("steady step <= torch.compile reduce-overhead (best packgraph variant)", checks_step),
        _verdict("first step >= 10x faster than compile reduce-overhead", checks_first),
        _verdict("<= 8 graphs over the varied batches (200 in a full run)", checks_graphs),
    ]


def _document_mask(by_cell: Cells) -> list[dict[str, Any]]:
    """Issue #36's goals: one graph set for every packing on the document-mask backend, and packgraph's best
    variant at <= 0.90x compile reduce-overhead's step on the medium cell."""
    graphs, medium = [], []
    for (model, _, _), m in by_cell.items():
        for method in ("packgraph-docmask", "packgraph-docmask-model+compile"):
            docmask = m.get(method)
            if docmask and docmask.get("graphs") is not None:
                detail = f"{cell_label(docmask)} {method}: {docmask['graphs']} over {docmask['graph_batches']} batches"
                graphs.append((docmask["graphs"] <= 1, detail))
        ro, graphed = m.get("compile-ro"), [m[k] for k in GRAPHED if k in m]
        if model == "medium" and ro and graphed:
            best = min(graphed, key=lambda r: r["step_ms"])
            ratio = best["step_ms"] / ro["step_ms"]
            detail = f"{cell_label(ro)}: {best['method']} {best['step_ms']:.2f} / {ro['step_ms']:.2f} ms = {ratio:.2f}x"
            medium.append((ratio <= 0.90, detail))
    return [
        _verdict("document-mask backend: 1 graph set over every varied stream", graphs),
        _verdict("medium: best packgraph variant <= 0.90x compile reduce-overhead", medium),
    ]


def _memory(by_cell: Cells) -> list[dict[str, Any]]:
    """Peak allocated and peak reserved memory of every graphed method against eager's in the same cell."""
    alloc, reserved = [], []
    for m in by_cell.values():
        eager = m.get("eager")
        for method in GRAPHED:
            pg = m.get(method)
            if pg is None or eager is None:
                continue
            label = f"{cell_label(pg)} {method}"
            if pg.get("peak_mem_mib") and eager.get("peak_mem_mib"):
                ratio = pg["peak_mem_mib"] / eager["peak_mem_mib"]
                detail = f"{label}: {pg['peak_mem_mib']:.0f} MiB = {ratio:.4f}x"
                if pg.get("peak_requested_mib") and eager.get("peak_requested_mib"):
                    detail += f" (requested {pg['peak_requested_mib'] / eager['peak_requested_mib']:.4f}x)"
                alloc.append((ratio <= 1.00, detail))
            if pg.get("peak_reserved_mib") and eager.get("peak_reserved_mib"):
                ratio = pg["peak_reserved_mib"] / eager["peak_reserved_mib"]
                reserved.append((ratio <= 1.10, f"{label}: {ratio:.2f}x"))
    return [
        _verdict("packgraph peak allocated <= 1.00x eager, every cell and method", alloc),
        _verdict("packgraph peak reserved <= 1.10x eager, every cell and method", reserved),
    ]


def _evictions(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    checks = [
        (r["extra"]["evictions"] == 0, f"{cell_label(r)} {r['method']}: {r['extra']['evictions']}")
        for r in records
        if r["status"] == "ok" and "evictions" in r.get("extra", {})
    ]
    return _verdict("no evictions over the varied-batch streams", checks)


def _tokens_vs_padded(by_cell: Cells) -> dict[str, Any]:
    checks = []
    for (_, _, mix), m in by_cell.items():
        padded = m.get("padded")
        graphed = [m[k] for k in GRAPHED if k in m and m[k].get("tokens_per_s")]
        if mix == "corpus" and padded and padded.get("tokens_per_s") and graphed:
            best = max(graphed, key=lambda r: r["tokens_per_s"])
            ratio = best["tokens_per_s"] / padded["tokens_per_s"]
            checks.append((ratio >= 2.0, f"{cell_label(padded)}: {best['method']} {ratio:.2f}x padded tokens/s"))
    return _verdict("packed+graphed tokens/s >= 2x padded eager on the corpus mix", checks)


def check_targets(results_json: str | Path | Mapping[str, Any]) -> list[dict[str, Any]]:
    """Evaluate the benchmark issue's targets: ``[{target, met (True/False/None = not measured), detail}]``."""
    doc = load_results(results_json)
    records = doc.get("records", [])
    by_cell = _by_cell(records)
    return [
        *_step_over_busy(records),
        _gpu_busy(by_cell),
        _attention(doc),
        *_versus_compile_ro(by_cell),
        *_memory(by_cell),
        *_document_mask(by_cell),
        _evictions(records),
        _tokens_vs_padded(by_cell),
    ]


def format_targets(targets: Iterable[Mapping[str, Any]]) -> str:
    """One line per target: ``[met]``, ``[NOT met]`` or ``[not measured]``, then the figures."""
    label = {True: "[met]", False: "[NOT met]", None: "[not measured]"}
    return "\n".join(f"- {label[t['met']]} {t['target']}: {t['detail']}" for t in targets)


def report_rows(targets: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The verdicts as rows of ``scripts/gpu-check``'s report (its closing table prints name and value)."""
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    return [
        {
            "test": "packgraph bench",
            "name": f"target: {t['target']}",
            "value": f"{verdict[t['met']]} ({t['detail'][:160]})",
            "unit": "",
        }
        for t in targets
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Print the verdicts of each results file (and append them to ``--report``); returns 0."""
    parser = argparse.ArgumentParser(prog="python -m packgraph.bench.targets", description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.json files (or their directories)")
    parser.add_argument("--report", type=Path, help="also append the verdicts to this gpu-check report (JSON lines)")
    args = parser.parse_args(argv)
    for path in args.results:
        targets = check_targets(path)
        print(f"Targets, as evaluated on {path}:\n{format_targets(targets)}")
        if args.report is not None:
            with args.report.open("a") as f:
                for row in report_rows(targets):
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
