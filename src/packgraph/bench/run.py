"""``packgraph bench``: packgraph against eager, torch.compile and padded batching, measured side by side.

A run measures a matrix of cells (GPT preset x tokens per step ``T`` x length mix), every method in each cell
(:mod:`packgraph.bench.methods`, measured by :mod:`packgraph.bench.measure`), and optionally the attention
micro-benchmark (:mod:`packgraph.bench.attention`). It writes, under ``--out`` (default
``bench/results/<YYYY-MM-DD>-<gpu-slug>/``):

* ``results.json``: ``machine`` (GPU, driver, CPU, versions), ``runs`` (the exact argv of each run), ``streams``,
  ``records`` (one per model x T x mix x method), ``attention`` rows, ``attention_summary`` and
  ``attention_recommendation``;
* ``results.md``: the tables;
* ``step_ms.png`` and ``attention.png`` when matplotlib is installed.

Runs **append**: a later run into the same directory replaces records with the same (model, T, mix, method)
and keeps the rest, so the full matrix can be measured in parts (``--models``, ``--T``, ``--mixes``,
``--methods``). Results are saved after every method, so a run that is killed keeps what it measured.
A method that fails records its error string; the matrix goes on.

Presets (:mod:`packgraph.bench.presets`; the flags: :mod:`packgraph.bench.options`): ``--quick`` (what
``scripts/gpu-check`` runs: small, T=2048, corpus, the key methods, a reduced attention sweep; a few minutes on an
H200), ``--standard`` (the committed H200 run: chosen cells of the full matrix, each with its own methods, and the
attention sweep at T=8192 and 16384; about 9 minutes), ``--full`` (the issue's whole matrix; add ``--attention``
once for its sweep), ``--dry-run`` (a tiny CPU matrix with ``perf_counter`` timing that exercises the harness end
to end). ``--cell MODEL:T:MIX[:METHOD,...]`` (repeatable) measures exactly the cells named; on a cell preset,
``--models``/``--T``/``--mixes``/``--methods`` narrow it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from packgraph.bench.data import batch_stream, stream_stats
from packgraph.bench.machine import default_out_dir, machine_info
from packgraph.bench.measure import measure, release
from packgraph.bench.methods import CUDA_ONLY_METHODS, make_method
from packgraph.bench.options import build_parser, resolve
from packgraph.bench.presets import ladder_policy
from packgraph.bench.report import RECORD_FIELDS, compare_table, derive, record_key, results_markdown, results_table
from packgraph.graphs.recorder import loop_stream
from packgraph.models.gpt import GPT, GPTConfig

__all__ = ["main", "publish_report", "run_bench", "save"]


# ---------------------------------------------------------------------------------------------- progress
class _Progress:
    """tqdm when installed, else one line per unit."""

    def __init__(self, total: int, time_limit_s: float | None = None) -> None:
        self._bar = None
        self.time_limit_s = time_limit_s
        if sys.stderr.isatty():  # a log file gets plain lines, not carriage-return redraws
            try:
                from tqdm.auto import tqdm

                self._bar = tqdm(total=total, desc="bench", unit="run", file=sys.stderr)
            except ImportError:
                pass
        self.total, self.done = total, 0
        self.started = time.perf_counter()

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(text)
        else:
            elapsed = time.perf_counter() - self.started
            print(f"[bench {self.done}/{self.total} +{elapsed:.0f}s] {text}", file=sys.stderr, flush=True)

    def out_of_time(self) -> bool:
        """Whether the run's time limit has passed (units not started by then are skipped)."""
        return self.time_limit_s is not None and time.perf_counter() - self.started > self.time_limit_s

    def advance(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# ---------------------------------------------------------------------------------------------- results
def _load(path: Path) -> dict[str, Any]:
    if path.exists():
        doc = json.loads(path.read_text())
        doc.setdefault("runs", [])
        return doc
    return {"machine": None, "runs": [], "streams": [], "records": [], "attention": [], "attention_summary": []}


def _merge(items: list[dict], new: dict, key) -> None:
    """Replace the item with ``new``'s key, or append."""
    k = key(new)
    for i, item in enumerate(items):
        if key(item) == k:
            items[i] = new
            return
    items.append(new)


def _attention_key(r: dict) -> tuple:
    return r["T"], r["mix"], r["head_dim"], r["heads"], r["packing"], r["max_seqlen"], r["capacity"]


def save(doc: dict[str, Any], out: Path, *, plots: bool = False) -> None:
    """Recompute the derived figures, then write results.json, results.md (and the plots)."""
    derive(doc["records"])
    # the goals are judged apart (packgraph.bench.targets): verdicts kept from an older results.json would not
    # follow the records this run replaces
    doc.pop("targets", None)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False, default=str) + "\n")
    tmp.replace(out / "results.json")
    (out / "results.md").write_text(results_markdown(doc))
    if plots:
        from packgraph.bench.plots import plot_results

        try:
            plot_results(doc, out)
        except Exception as exc:  # a plotting problem must not lose the measurements (already written)
            print(f"warning: plots not written: {_describe_error(exc)}", file=sys.stderr)


def _error_record(model: str, T: int, mix: str, method: str, device: torch.device, err: str, run: int) -> dict:
    """A record of a method that did not run: every :data:`RECORD_FIELDS` key, figures None."""
    record = dict.fromkeys(RECORD_FIELDS)
    record.update(model=model, T=T, mix=mix, method=method, status="error", error=err, device=str(device))
    return record | dict(steps=0, extra={}, run=run)


def _describe_error(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    text = f"{type(exc).__name__}: {exc}".strip()
    return (text[:600] + "...") if len(text) > 600 else text + where


# ---------------------------------------------------------------------------------------------- the run
def run_bench(cfg: dict[str, Any], out: Path, argv: Sequence[str], device: torch.device) -> dict[str, Any]:
    """Run the matrix and the attention sweep described by ``cfg`` (a resolved preset), appending to ``out``."""
    doc = _load(out / "results.json")
    machine = machine_info(device)
    if doc.get("machine") and doc["machine"].get("gpu") != machine["gpu"]:
        print(f"warning: {out} holds results from {doc['machine'].get('gpu')}; appending {machine['gpu']}")
    doc["machine"] = doc.get("machine") or machine
    run_index = len(doc["runs"])
    doc["runs"].append({"argv": list(argv), "date": machine["date"], "machine": machine, "config": cfg})
    att = cfg["attention"]
    n_att = len(att["T"]) * len(att["mixes"]) * len(att["head_dims"]) * att["packings"] if cfg["run_attention"] else 0
    n_cells = sum(len(methods) for *_, methods in cfg["cells"]) if cfg["run_matrix"] else 0
    progress = _Progress(n_cells + n_att, time_limit_s=cfg.get("time_limit_s"))
    try:
        # the attention sweep is short: run it first, so a run cut short by a time limit still has it
        if cfg["run_attention"]:
            _run_attention(cfg, doc, out, device, progress)
        if cfg["run_matrix"]:
            _run_matrix(cfg, doc, out, device, run_index, progress)
    finally:
        progress.close()
        doc["runs"][run_index]["finished"] = dt.datetime.now().astimezone().isoformat(timespec="seconds")
        save(doc, out, plots=True)
    return doc


def _run_matrix(cfg: dict, doc: dict, out: Path, device: torch.device, run: int, progress: _Progress) -> None:
    n_stream = max(cfg["steps"], cfg["graph_batches"]) + 1
    streams: dict[tuple[int, str], list] = {}
    for model_name, T, mix, methods in cfg["cells"]:
        policy = ladder_policy(cfg.get("ladder", "default"), T)
        if (T, mix) not in streams:
            progress.describe(f"building the {mix} stream for T={T}")
            stream = batch_stream(
                mix, T, n_stream, seed=cfg["seed"], policy=policy, max_corpus_docs=cfg["max_corpus_docs"]
            )
            stats = stream_stats(mix, T, stream[: max(cfg["graph_batches"], cfg["steps"])], policy)
            _merge(doc.setdefault("streams", []), asdict(stats), lambda s: (s["T"], s["mix"]))
            streams[T, mix] = stream
        stream = streams[T, mix]
        for method in methods:
            progress.describe(f"{model_name} T={T} {mix} {method}")
            if progress.out_of_time():
                why = f"not run: the run's time limit ({cfg['time_limit_s']:.0f} s) had passed"
                record = _error_record(model_name, T, mix, method, device, why, run) | {"status": "skipped"}
            else:
                record = _run_one(model_name, T, mix, method, stream, policy, cfg, device, run)
            _merge(doc["records"], record, record_key)
            save(doc, out)
            line = f"{model_name} T={T} {mix} {method}: "
            if record["status"] == "ok":
                line += f"{record['step_ms']:.2f} ms/step, first step {record['first_step_s']:.1f} s"
            else:
                line += record["error"]
            progress.write(line)
            progress.advance()


def _run_one(model_name, T, mix, method, stream, policy, cfg, device, run) -> dict[str, Any]:
    if method in CUDA_ONLY_METHODS and device.type != "cuda":
        skipped = _error_record(model_name, T, mix, method, device, "needs CUDA (no CUDA device here)", run)
        return skipped | {"status": "skipped"}
    # Blocks an earlier unit left (the attention sweep's, the last method's graphs and pools) would count in this
    # method's reserved peak: each method starts from an empty cache.
    release(device)
    # Each method runs on one stream of its own, eager code and graphs alike: the graphs' cuBLAS workspaces are
    # then the eager code's, as in packgraph's trainers (packgraph.graphs.recorder).
    with loop_stream(device):
        return _measure_one(model_name, T, mix, method, stream, policy, cfg, device, run)


def _measure_one(model_name, T, mix, method, stream, policy, cfg, device, run) -> dict[str, Any]:
    model = bench_method = None
    try:
        torch.manual_seed(cfg["seed"])
        with torch.device(device):  # initialise on the device: the same weights for every method
            model = GPT(GPTConfig.preset(model_name))
        bench_method = make_method(method, model, policy, device)
        m = measure(
            bench_method,
            stream,
            steps=cfg["steps"],
            warmup=cfg["warmup"],
            graph_batches=cfg["graph_batches"],
            graph_budget_s=cfg["graph_budget_s"],
            profile=cfg["profile"],
        )
        record = dict(model=model_name, T=T, mix=mix, method=method, status="ok", error=None, device=str(device))
        derived = dict(tokens_per_s=None, speedup_vs_eager=None, step_over_busy=None, first_loss_vs_eager=None)
        return record | asdict(m) | derived | dict(run=run)
    except Exception as exc:  # one failing method must not stop the matrix
        return _error_record(model_name, T, mix, method, device, _describe_error(exc), run)
    finally:
        if bench_method is not None:
            try:
                bench_method.close()
            except Exception as exc:  # cleanup must not end the matrix (e.g. after a device-side fault)
                print(f"warning: closing {method} failed: {_describe_error(exc)}", file=sys.stderr)


def _run_attention(cfg: dict, doc: dict, out: Path, device: torch.device, progress: _Progress) -> None:
    from packgraph.bench.attention import attention_benchmark, evaluate_ladders, recommend_ladder

    att = cfg["attention"]
    progress.describe("attention micro-benchmark")
    try:
        rows = attention_benchmark(
            att["T"],
            att["mixes"],
            att["head_dims"],
            heads=att["heads"],
            packings=att["packings"],
            reps=att["reps"],
            seed=cfg["seed"],
            device=device,
            max_corpus_docs=cfg["max_corpus_docs"],
            on_packing=progress.advance,
        )
    except Exception as exc:
        progress.write(f"attention micro-benchmark failed: {_describe_error(exc)}")
        doc["attention_error"] = _describe_error(exc)
        return
    for row in rows:
        _merge(doc.setdefault("attention", []), row, _attention_key)
    doc["attention_summary"] = evaluate_ladders(doc["attention"])
    doc["attention_recommendation"] = {str(T): rec for T, rec in recommend_ladder(doc["attention_summary"]).items()}
    save(doc, out)


def publish_report(
    path: Path, records: Sequence[dict[str, Any]], doc: dict[str, Any], *, attention: bool = True
) -> None:
    """Append this run's records (and its attention ladder when ``attention``) to ``scripts/gpu-check``'s report
    (JSON lines)."""
    rows = []
    for r in records:
        if r["status"] != "ok":
            value = f"{r['status']}: {(r['error'] or '')[:100]}"
        else:
            value = f"{r['step_ms']:.2f} ms"
            for label, key, spec in (("x eager", "speedup_vs_eager", ".2f"), ("x busy", "step_over_busy", ".2f")):
                if r.get(key) is not None:
                    value += f", {format(r[key], spec)}{label}"
            value += f", first step {r['first_step_s']:.1f} s"
            if r.get("graphs") is not None:
                value += f", {r['graphs']} graphs / {r['graph_batches']} batches"
        rows.append({"name": f"bench {r['model']} T={r['T']} {r['mix']} {r['method']}", "value": value})
    for T, rec in (doc.get("attention_recommendation") or {}).items() if attention else ():
        value = "none within 1.10x" if rec is None else f"{rec['max_seqlen_ladder']} x {rec['capacity_ladder']}"
        rows.append({"name": f"bench attention T={T}: ladder within 1.10x, fewest buckets", "value": value})
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps({"test": "packgraph bench", **row, "unit": ""}) + "\n")


# ---------------------------------------------------------------------------------------------- CLI
def _device(args: argparse.Namespace) -> torch.device:
    """``--device``, else cuda when available (cpu for ``--dry-run``)."""
    if args.device:
        return torch.device(args.device)
    if args.dry_run or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``packgraph bench``; returns the exit status (0 when at least one measurement worked)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compare:
        try:
            print(compare_table(*args.compare))
        except FileNotFoundError as exc:  # load_results resolves a folder to its results.json
            parser.error(f"--compare: no results.json at {exc.filename}")
        return 0
    try:
        cfg = resolve(args)
    except ValueError as exc:
        parser.error(str(exc))
    device = _device(args)
    if args.backends:
        return _run_backends(args, device)
    if device.type != "cuda" and not args.dry_run:
        print("warning: no CUDA device; CUDA-only methods are skipped and timings are CPU timings", file=sys.stderr)
    out = args.out or default_out_dir(device, args.dry_run)
    started = time.perf_counter()
    doc = run_bench(cfg, out, argv, device)
    records = [r for r in doc["records"] if r.get("run") == len(doc["runs"]) - 1]
    print(results_table(records))
    print(f"\nwrote {out}/results.json and results.md in {time.perf_counter() - started:.0f} s")
    if os.environ.get("PACKGRAPH_REPORT"):
        publish_report(Path(os.environ["PACKGRAPH_REPORT"]), records, doc, attention=cfg["run_attention"])
    ok = any(r["status"] == "ok" for r in records) or (not cfg["run_matrix"] and bool(doc.get("attention")))
    return 0 if ok else 1


def _run_backends(args: argparse.Namespace, device: torch.device) -> int:
    """``packgraph bench --backends``: writes backends.json (with the machine) and backends.md under --out: the FA2
    wrapper's kernels, the FlexAttention tile study, the declared-size sweep (corpus mix, the largest head size) and
    the short-documents switch at each T, then the backends side by side."""
    from packgraph.bench.backends import (
        BACKENDS,
        FLEX_TILES,
        backend_benchmark,
        backends_markdown,
        declared_size_sweep,
        error_line,
        flex_tiles,
        kernels_markdown,
        short_docs_switch,
        sweep_markdown,
        switch_doc_counts,
        switch_markdown,
        tiles_markdown,
        wrapper_kernels,
    )
    from packgraph.bench.data import MIXES

    T_values = args.T or [4096, 8192, 16384, 32768]
    mixes, head_dims = args.mixes or list(MIXES), args.head_dims or [64, 128]
    out = args.out or default_out_dir(device, dry_run=False)
    out.mkdir(parents=True, exist_ok=True)
    packings = args.packings
    tiles_T = None if args.no_tiles else next((T for T in T_values if T >= 8192), max(T_values))
    tile_rows = 0 if tiles_T is None else len(head_dims) * 3 * (len(FLEX_TILES) + 1)
    switch_rows = sum(len(head_dims) * 2 * len(switch_doc_counts(T)) for T in T_values)
    progress = _Progress(
        len(T_values) * (len(mixes) * len(head_dims) * packings * len(BACKENDS) + 1) + tile_rows + switch_rows,
        time_limit_s=args.time_limit_s,
    )

    def on_row(row: dict[str, Any]) -> None:
        if "shape" in row:
            shown = row.get("error") or f"short_docs {row['short_ms']:.3f} ms, FA2 {row['fa2_ms']:.3f} ms"
            where = f"T={row['T']} D={row['head_dim']} {row['shape']} {row['docs']} docs (capacity {row['capacity']})"
            progress.write(f"{where}: {shown}")
            progress.advance()
        elif "tiles" in row:
            shown = row.get("error") or f"fwd {row['fwd_ms']:.3f} ms, fwd+bwd {row['fwdbwd_ms']:.3f} ms"
            where = f"T={row['T']} {row['mix']} D={row['head_dim']} {row['backend']} [{row['tiles']}]"
            progress.write(f"{where}: {shown}, first {row.get('first_s', 0):.1f} s")
            progress.advance()
        elif "axis" not in row:
            shown = row.get("error") or f"fwd {row['fwd_ms']:.3f} ms, fwd+bwd {row['fwdbwd_ms']:.3f} ms"
            progress.write(f"T={row['T']} {row['mix']} D={row['head_dim']} #{row['packing']} {row['backend']}: {shown}")
            progress.advance()

    started = time.perf_counter()
    sweep: list[dict[str, Any]] = []
    switch: list[dict[str, Any]] = []
    # First, as it is short and names the wrapper's cost: the kernels of FA2 through packgraph and bare (CUDA only).
    kernels: list[dict[str, Any]] = []
    kernels_error = None
    if device.type == "cuda":
        try:
            kernels = [r for T in T_values[:2] for r in wrapper_kernels(T, max(head_dims), device=device)]
        except RuntimeError as exc:  # recorded, and the timings still run
            kernels_error = error_line(exc)
            print(f"warning: the wrapper's kernel profile failed ({kernels_error})", file=sys.stderr)
    tiles: list[dict[str, Any]] = []
    try:  # the studies before the matrix: a time limit cuts the matrix's last rows, not them
        if tiles_T is not None:
            tiles = flex_tiles(
                tiles_T, head_dims, seed=args.seed, device=device, out_of_time=progress.out_of_time, on_row=on_row
            )
        for T in T_values:
            sweep += declared_size_sweep(
                T, max(head_dims), seed=args.seed, device=device, out_of_time=progress.out_of_time, on_row=on_row
            )
            progress.advance()
            switch += short_docs_switch(
                T, head_dims, seed=args.seed, device=device, out_of_time=progress.out_of_time, on_row=on_row
            )
        rows = backend_benchmark(
            T_values,
            mixes,
            head_dims,
            packings=packings,
            seed=args.seed,
            device=device,
            out_of_time=progress.out_of_time,
            on_row=on_row,
        )
    finally:
        progress.close()
    doc = {
        "machine": machine_info(device),
        "argv": sys.argv[1:],
        "rows": rows,
        "sweep": sweep,
        "switch": switch,
        "kernels": kernels,
        "tiles": tiles,
    }
    if kernels_error:
        doc["kernels_error"] = kernels_error
    (out / "backends.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tables = (
        backends_markdown(rows) + "\nDeclared sizes, one packing each (forward+backward):\n\n" + sweep_markdown(sweep)
    )
    if switch:
        tables += "\nShort documents (short_docs) against one FA2 call, on the bucket:\n\n" + switch_markdown(switch)
    if tiles:
        tables += "\nThe document mask's kernel under FlexAttention tile choices:\n\n" + tiles_markdown(tiles)
    if kernels:
        tables += "\nKernels of one forward+backward, FA2 through packgraph and bare:\n\n" + kernels_markdown(kernels)
    (out / "backends.md").write_text(tables)
    if tiles:
        from packgraph.bench.plots import plot_tiles

        try:
            plot_tiles(tiles, out / "tiles.png")
        except Exception as exc:  # a plotting problem must not lose the measurements (already written)
            print(f"warning: tiles.png not written: {error_line(exc)}", file=sys.stderr)
    print(tables)
    print(f"wrote {out}/backends.json and backends.md in {time.perf_counter() - started:.0f} s")
    return 0 if any(r.get("fwd_ms") is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
