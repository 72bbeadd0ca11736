"""The flags of ``packgraph bench`` and how they resolve, over a preset, into the configuration of one run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from packgraph.bench.data import MIXES
from packgraph.bench.methods import ALL_METHODS
from packgraph.bench.presets import LADDERS, PRESETS
from packgraph.models.gpt import PRESETS as MODEL_PRESETS

__all__ = ["build_parser", "resolve"]


def _cell(text: str) -> list:
    parts = text.split(":")
    if len(parts) not in (3, 4) or not parts[1].isdigit():
        raise argparse.ArgumentTypeError(f"expected MODEL:T:MIX[:METHOD,METHOD...], got {text!r}")
    # commas, not "+": method names such as "packgraph+compile" contain a plus
    methods = [m for m in parts[3].split(",") if m] if len(parts) == 4 else None
    unknown = [m for m in methods or [] if m not in ALL_METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown} in {text!r}; choose from {ALL_METHODS}")
    return [parts[0], int(parts[1]), parts[2], methods]


def _csv(kind):
    def parse(text: str) -> list:
        items = [kind(x) for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        return items

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="packgraph bench",
        description="Benchmark packgraph against eager, torch.compile and padded batching; write JSON, Markdown "
        "and PNG under --out. Runs append to the same directory.",
    )
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--quick", action="store_true", help="the gpu-check preset (default): small, T=2048, corpus")
    preset.add_argument("--full", action="store_true", help="the full matrix: small/medium/large x 3 T x 3 mixes")
    preset.add_argument(
        "--standard", action="store_true", help="the committed H200 run: chosen cells of the full matrix (< 10 min)"
    )
    preset.add_argument(
        "--ddp", action="store_true", help="torch DDP against the explicit all-reduce, world size 1: small and medium"
    )
    preset.add_argument(
        "--backends",
        action="store_true",
        help="the attention backends side by side (FA2 through packgraph, the bare FA2 op, the document mask): "
        "ms and TFLOP/s over --T (default 4096-32768), --mixes and --head-dims",
    )
    preset.add_argument("--dry-run", action="store_true", help="a tiny CPU matrix (perf_counter timing)")
    preset.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("BEFORE", "AFTER"),
        help="print two results.json files (or their folders) cell by cell, and run nothing",
    )
    p.add_argument("--out", type=Path, help="results directory (default bench/results/<date>-<gpu>/)")
    p.add_argument("--models", type=_csv(str), help="GPT presets, e.g. small,medium")
    p.add_argument("--T", type=_csv(int), help="tokens per step, e.g. 2048,8192")
    p.add_argument("--mixes", type=_csv(str), help=f"length mixes from {','.join(MIXES)}")
    p.add_argument("--methods", type=_csv(str), help=f"methods from {','.join(ALL_METHODS)}")
    p.add_argument(
        "--cell",
        action="append",
        type=_cell,
        help="one cell MODEL:T:MIX[:METHOD,METHOD...] (repeatable; replaces the --models x --T x --mixes matrix)",
    )
    p.add_argument("--steps", type=int, help="timed steps per method (the median is reported)")
    p.add_argument("--warmup", type=int, help="warm-up steps of methods without a graph/compile cache")
    p.add_argument("--graph-batches", type=int, help="varied batches over which graphs are counted")
    p.add_argument("--graph-budget-s", type=float, help="time cap of the graph-count phase per method")
    p.add_argument("--no-profile", action="store_true", help="skip the torch.profiler GPU-busy step")
    p.add_argument(
        "--time-limit-s", type=float, help="skip the units not started after this many seconds (they are recorded)"
    )
    att = p.add_mutually_exclusive_group()
    att.add_argument(
        "--attention", action="store_true", help="also run the attention micro-benchmark (default with --quick)"
    )
    att.add_argument("--attention-only", action="store_true", help="run only the attention micro-benchmark")
    att.add_argument("--no-attention", action="store_true", help="skip the attention micro-benchmark")
    p.add_argument("--attention-T", type=_csv(int), help="T values of the attention sweep")
    p.add_argument("--head-dims", type=_csv(int), help="head sizes of --backends (default 64,128)")
    p.add_argument("--packings", type=int, default=2, help="packings per (T, mix) of --backends (default 2)")
    p.add_argument(
        "--no-tiles",
        action="store_true",
        help="skip --backends' FlexAttention tile study (run at the first T >= 8192, else the largest)",
    )
    p.add_argument(
        "--ladder",
        choices=LADDERS,
        default="default",
        help="the bucket ladder of the graphed and compiled methods (and of the bucket tour): default_buckets(T), "
        "or x2 capacity rungs (capacity-x2), or x2 rungs on both axes (both-x2)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="override the device (default: cuda when available; cpu for --dry-run)")
    return p


_OVERRIDES = ("models", "T", "mixes", "methods", "steps", "warmup", "graph_batches", "graph_budget_s", "time_limit_s")
"""The flags that replace a preset's value when given."""


def _preset_name(args: argparse.Namespace) -> str:
    if args.dry_run:
        return "dry-run"
    return "full" if args.full else "standard" if args.standard else "ddp" if args.ddp else "quick"


def _narrowed(cells: list[list], args: argparse.Namespace) -> list[list]:
    """A cell preset's cells, narrowed by ``--models`` / ``--T`` / ``--mixes`` / ``--methods`` (empty ones dropped)."""
    keep = (args.models, args.T, args.mixes)
    narrowed = [
        [m, T, mix, [x for x in methods if args.methods is None or x in args.methods]]
        for m, T, mix, methods in cells
        if all(v is None or c in v for c, v in zip((m, T, mix), keep, strict=True))
    ]
    return [c for c in narrowed if c[3]]


def _cells(cfg: dict[str, Any], args: argparse.Namespace) -> list[list]:
    """``[model, T, mix, methods]`` of every cell to measure: the ``--cell`` flags, else the preset's cells
    (narrowed), else its grid."""
    if args.cell:
        return [[m, T, mix, methods or list(cfg["methods"])] for m, T, mix, methods in args.cell]
    if "cells" in cfg:
        return _narrowed(cfg["cells"], args)
    grid = [(m, T, mix) for T in cfg["T"] for mix in cfg["mixes"] for m in cfg["models"]]
    return [[m, T, mix, list(cfg["methods"])] for m, T, mix in grid]


def _axes_from_cells(cfg: dict[str, Any]) -> None:
    """Set ``models``, ``T``, ``mixes`` and ``methods`` to what the cells hold."""
    cfg["models"] = sorted({c[0] for c in cfg["cells"]})
    cfg["T"] = sorted({c[1] for c in cfg["cells"]})
    cfg["mixes"] = sorted({c[2] for c in cfg["cells"]})
    cfg["methods"] = list(dict.fromkeys(m for c in cfg["cells"] for m in c[3]))


def _validate(cfg: dict[str, Any]) -> None:
    for key, known in (("models", MODEL_PRESETS), ("mixes", MIXES), ("methods", ALL_METHODS)):
        unknown = [x for x in cfg[key] if x not in known]
        if unknown:
            raise ValueError(f"unknown {key} {unknown}; choose from {','.join(known)}")
    if cfg["steps"] < 1 or cfg["warmup"] < 0 or cfg["graph_batches"] < 0 or any(T < 1 for T in cfg["T"]):
        raise ValueError("--steps must be >= 1, --warmup and --graph-batches >= 0, every T >= 1")


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """The preset named by the flags, with every explicit flag applied over it.

    Raises:
        ValueError: an unknown model, mix or method, or a non-positive count.
    """
    name = _preset_name(args)
    cfg = json.loads(json.dumps(PRESETS[name]))  # a deep copy
    cfg["preset"] = name
    cfg.setdefault("time_limit_s", None)
    for key in _OVERRIDES:
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    cfg["cells"] = _cells(cfg, args)
    _axes_from_cells(cfg)
    if args.attention_T:
        cfg["attention"]["T"] = args.attention_T
    if args.mixes:
        cfg["attention"]["mixes"] = args.mixes  # (cfg["mixes"] is derived from the cells above)
    cfg["seed"], cfg["profile"], cfg["ladder"] = args.seed, not args.no_profile, args.ladder
    # --quick and --dry-run include the attention sweep; --full runs it only when asked, since a full matrix is
    # usually measured in parts and the sweep needs running once
    cfg["run_attention"] = args.attention or args.attention_only or (name != "full" and not args.no_attention)
    cfg["run_matrix"] = not args.attention_only
    _validate(cfg)
    return cfg
