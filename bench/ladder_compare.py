"""Compare ``packgraph bench`` runs that differ by ``--ladder``: per cell and graphed method, the ladder's graphs,
the steady step, GPU-busy against eager's on the same stream, and peak allocated / requested against eager's.

    python3 bench/ladder_compare.py RUN_DIR_OR_RESULTS_JSON [...]

Each run is one ``results.json`` (or the folder holding it). Ratios are taken inside a run only: the bucket tour
is built from the run's own ladder, so its eager baseline differs between ladders. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from packgraph.bench.report import load_results  # noqa: E402


def _graphed_methods() -> tuple[str, ...]:
    """``bench/targets.py``'s ``GRAPHED``, by path (``bench/`` is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_targets", Path(__file__).with_name("targets.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GRAPHED


GRAPHED = _graphed_methods()
"""The methods that replay packgraph's graphs, as the targets count them."""


def _ladder(doc: Mapping[str, Any]) -> str:
    runs = doc.get("runs", [])
    return runs[-1].get("config", {}).get("ladder", "default") if runs else "default"


def rows(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per graphed ``ok`` record that has an ``ok`` eager record in its cell."""
    ok = [r for r in doc.get("records", []) if r["status"] == "ok"]
    eager = {(r["model"], r["T"], r["mix"]): r for r in ok if r["method"] == "eager"}
    out = []
    for r in ok:
        e = eager.get((r["model"], r["T"], r["mix"]))
        if r["method"] not in GRAPHED or e is None:
            continue
        busy = r["gpu_busy_ms"] / e["gpu_busy_ms"] if r.get("gpu_busy_ms") and e.get("gpu_busy_ms") else None
        req = (
            r["peak_requested_mib"] / e["peak_requested_mib"]
            if r.get("peak_requested_mib") and e.get("peak_requested_mib")
            else None
        )
        out.append(
            dict(
                ladder=_ladder(doc),
                cell=f"{r['model']} T={r['T']} {r['mix']}",
                method=r["method"],
                graphs=r.get("graphs"),
                step_ms=r["step_ms"],
                busy=busy,
                allocated=r["peak_mem_mib"] / e["peak_mem_mib"],
                requested=req,
            )
        )
    return out


def table(all_rows: Sequence[Mapping[str, Any]]) -> str:
    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = [
        "| cell | method | ladder | graphs | step ms | GPU-busy / eager | allocated / eager | requested / eager |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(all_rows, key=lambda r: (r["cell"], r["method"])):
        lines.append(
            f"| {r['cell']} | {r['method']} | {r['ladder']} | {f(r['graphs'], 'd')} | {r['step_ms']:.2f} | "
            f"{f(r['busy'], '.3f')} | {r['allocated']:.4f} | {f(r['requested'], '.4f')} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="results.json files or the folders holding them")
    args = p.parse_args()
    all_rows = []
    for path in args.results:
        path = Path(path)
        all_rows += rows(load_results(path / "results.json" if path.is_dir() else path))
    print(table(all_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
