"""``packgraph``: the command line (demo, train, score, bench, plot-convergence).

Every command that writes artefacts writes them under an out dir it prints (default
``./runs/<command>-<timestamp>``, a new one each time). An out dir that already holds the files an earlier run of
the same command wrote is refused, so that no run is overwritten by accident or mixed with another: ``--overwrite``
deletes those files first (packgraph's own files only; nothing else in the dir), and ``train --resume`` from a
checkpoint of that very dir continues its run there. Bad flags, values and paths exit with code 2 and a one-line
message, no traceback (set ``PACKGRAPH_DEBUG=1`` to get the traceback of a rejected value).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main", "build_parser", "CLIError"]


class CLIError(Exception):
    """A user error: printed as ``packgraph: error: <message>``, exit code 2."""


# ---------------------------------------------------------------------------------------------- parsing helpers
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _ladder(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 256,512,1024, got {text!r}") from None
    if not values or any(v < 1 for v in values) or any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise argparse.ArgumentTypeError(f"a ladder is strictly increasing positive integers, got {text!r}")
    return values


def _scopes(text: str) -> tuple[str, ...]:
    from packgraph.models.gpt import SCOPES

    values = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in values if v not in SCOPES]
    if bad or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct scopes from {','.join(SCOPES)}, got {text!r}")
    return values


# What each command writes in its out dir: an out dir holding any of it holds an earlier run, and --overwrite
# deletes exactly these files (train's are packgraph.train.trainer.run_files).
_WRITES = {
    "train": "config.json, train.jsonl, summary.json, loss.png, checkpoint.pt, checkpoint-<step>.pt",
    "score": "score.json, logprobs.pt",
    "demo": "demo.json, demo.png, and train's files in its run dirs eager/, eager-rerun/ and graphed-<scope>/",
}
_SCORE_FILE = re.compile(r"(score\.json|logprobs\.pt)(\.tmp)?")
_DEMO_RUN_DIR = re.compile(r"eager|eager-rerun|graphed-\w+")


def _earlier_run(out: Path, command: str) -> list[Path]:
    """The files in ``out`` that an earlier run of ``command`` wrote (``.tmp`` ones left by a killed write too)."""
    from packgraph.train.trainer import run_files

    if command == "train" or not out.is_dir():
        return run_files(out)
    if command == "score":
        return sorted(p for p in out.iterdir() if _SCORE_FILE.fullmatch(p.name) and not p.is_dir())
    found = [p for p in out.iterdir() if p.name in ("demo.json", "demo.png") and not p.is_dir()]
    for sub in out.iterdir():
        if sub.is_dir() and _DEMO_RUN_DIR.fullmatch(sub.name):
            found += run_files(sub)
    return sorted(found)


def _listed(files: Sequence[Path], out: Path, limit: int = 4) -> str:
    names = [str(f.relative_to(out)) for f in files]
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _out_path(args: argparse.Namespace, command: str) -> Path:
    """The out dir to use (not created yet: commands create it only once every flag has been checked).

    ``CLIError`` when it already holds an earlier run of ``command`` (see the module docstring), unless
    ``--overwrite`` is given or ``train --resume`` continues that run in place (its checkpoint is in the dir).
    """
    from packgraph.train import default_out_dir, resolve_checkpoint

    out = Path(args.out_dir) if args.out_dir else default_out_dir(command)
    if out.exists() and not out.is_dir():
        raise CLIError(f"--out-dir {out} exists and is not a directory")
    earlier = _earlier_run(out, command)
    if not earlier:
        return out
    resume = getattr(args, "resume", None)
    checkpoint = resolve_checkpoint(resume).resolve() if resume else None  # cmd_train has checked that it exists
    if args.overwrite:
        if checkpoint is not None and checkpoint in {f.resolve() for f in earlier}:
            raise CLIError(
                f"--overwrite would delete {checkpoint}, the checkpoint --resume continues from; drop --overwrite to "
                f"continue its run in {out}, or give another --out-dir"
            )
        return out
    if checkpoint is not None and checkpoint.parent == out.resolve():
        return out  # resumed in place: the log is cut after the checkpoint's step and continued
    held = f"--out-dir {out} already holds a {command} run ({_listed(earlier, out)})"
    if checkpoint is not None:
        held += f", and --resume {resume} is not a checkpoint of it"
    resume_hint = f"--resume {out} to continue it, " if command == "train" and checkpoint is None else ""
    raise CLIError(f"{held}: pass {resume_hint}--overwrite to delete those files first, or give another --out-dir")


def _make_dir(out: Path, command: str, args: argparse.Namespace) -> Path:
    """Create ``out``; with ``--overwrite``, delete the earlier run's files in it first (see :func:`_out_path`)."""
    earlier = _earlier_run(out, command) if args.overwrite else []
    try:
        for f in earlier:
            f.unlink(missing_ok=True)
        for d in sorted({f.parent for f in earlier} - {out}):  # the demo's run dirs, when nothing else is left there
            if not any(d.iterdir()):
                d.rmdir()
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CLIError(f"cannot prepare --out-dir {out}: {e.strerror} ({e.filename})") from None
    if earlier:
        print(f"--overwrite: deleted the earlier {command} run's files in {out} ({_listed(earlier, out)})")
    return out


def _add_common(p: argparse.ArgumentParser, *, T: int | None, command: str) -> None:
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=0, help="seed of init, data order and document splits")
    p.add_argument("--T", type=_positive_int, default=T, help="rows (tokens) per packed micro-batch")
    p.add_argument("--max-docs", type=_positive_int, default=None, help="use only the first N corpus files")
    p.add_argument(
        "--out-dir",
        default=None,
        help=f"where artefacts go (default ./runs/{command}-<timestamp>); one that holds an earlier {command} run is "
        "refused unless --overwrite" + (" or --resume from a checkpoint in it" if command == "train" else ""),
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help=f"replace the {command} run in --out-dir: first delete the files it wrote ({_WRITES[command]}); "
        "other files in the dir are kept",
    )


def _add_model_and_buckets(p: argparse.ArgumentParser, *, scope: bool = True) -> None:
    from packgraph.models.gpt import PRESETS, SCOPES

    p.add_argument("--preset", default=None, choices=sorted(PRESETS), help="model size")
    p.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run under CUDA graphs (default: on when the device is CUDA)",
    )
    if scope:
        p.add_argument("--scope", default="layer", choices=SCOPES, help="what is graphed (default layer)")
    p.add_argument(
        "--attention-backend",
        default="flash",
        choices=("flash", "doc_mask", "auto"),
        help="FlashAttention-2 over bucketed max_seqlen (flash), FlexAttention's document mask, one graph per layer "
        "for every packing (doc_mask), or the faster of the two measured on the device first (auto)",
    )
    p.add_argument("--max-seqlen-ladder", type=_ladder, default=None, help="static max_seqlen rungs, e.g. 256,512,2048")
    p.add_argument("--capacity-ladder", type=_ladder, default=None, help="cu_seqlens capacity rungs, e.g. 8,32,128")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="packgraph", description="Packed variable-length sequences (THD) under CUDA graphs."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    demo = sub.add_parser("demo", help="pack the embedded corpus and train a small GPT (eager; graphed too on CUDA)")
    _add_common(demo, T=None, command="demo")
    _add_model_and_buckets(demo, scope=False)
    demo.add_argument("--steps", type=_positive_int, default=None, help="training steps (default 50 CPU, 100 CUDA)")
    demo.add_argument(
        "--scopes", type=_scopes, default=("layer", "model"), help="graphed runs on CUDA, one per scope (layer,model)"
    )
    demo.add_argument(
        "--fast",
        action="store_true",
        help="non-deterministic kernels: faster, but then no two runs are bitwise equal, eager ones included",
    )

    train = sub.add_parser("train", help="train the reference GPT on the embedded corpus")
    _add_common(train, T=2048, command="train")
    _add_model_and_buckets(train)
    train.add_argument("--steps", type=_positive_int, default=200)
    train.add_argument("--lr", type=float, default=None, help="peak learning rate (default per preset)")
    train.add_argument("--warmup", type=int, default=None, help="warm-up steps (default min(100, steps/10))")
    train.add_argument("--grad-accum", type=_positive_int, default=1, help="micro-batches per step")
    train.add_argument(
        "--dp-engine",
        choices=("ddp", "allreduce"),  # packgraph.train.config.DP_ENGINES (not imported: parsing needs no torch)
        default="ddp",
        help="with --nproc: torch DDP (default) or packgraph's explicit all-reduce after backward",
    )
    train.add_argument("--chunk-len", type=_positive_int, default=None, help="longest document piece (default T)")
    train.add_argument(
        "--min-chunk-len", type=_positive_int, default=None, help="shortest document piece (default 64, or --chunk-len)"
    )
    train.add_argument(
        "--resume",
        default=None,
        help="checkpoint file, or a run dir holding checkpoint.pt; with --out-dir the checkpoint's own dir, its run "
        "continues there (train.jsonl cut after the checkpoint's step, then appended to)",
    )
    train.add_argument("--checkpoint-every", type=int, default=0, help="also keep checkpoint-<step>.pt every N steps")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--no-plot", action="store_true", help="no loss.png")
    train.add_argument(
        "--log-every",
        type=_positive_int,
        default=1,
        help="read losses from the device every N steps (fewer syncs; every step is still logged)",
    )
    train.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels only (bitwise reproducible runs; eager and graphed give the same losses)",
    )
    train.add_argument("--nproc", type=_positive_int, default=1, help="processes (GPUs) for data parallel")

    score = sub.add_parser("score", help="per-token logprobs of packed batches, graphed vs eager")
    _add_common(score, T=2048, command="score")
    _add_model_and_buckets(score)
    score.add_argument("--checkpoint", default=None, help="checkpoint file or run dir (default: a fresh init)")
    score.add_argument("--batches", type=_positive_int, default=8, help="how many packed batches to score")
    score.add_argument("--save-logprobs", action="store_true", help="also write logprobs.pt")

    sub.add_parser("bench", help="benchmarks (packgraph bench --help)", add_help=False)

    plot = sub.add_parser("plot-convergence", help="plot several train.jsonl loss curves; max smoothed difference")
    plot.add_argument("--logs", nargs="+", required=True, help="train.jsonl files (the first is the reference)")
    plot.add_argument("--labels", nargs="+", default=None, help="one label per log (default: parent dir names)")
    plot.add_argument("--out", required=True, help="PNG to write (a .json summary is written next to it)")
    plot.add_argument("--ema", type=float, default=0.95, help="EMA factor of the smoothing (default 0.95)")
    return parser


# ---------------------------------------------------------------------------------------------- commands
def _device(name: str):
    from packgraph.train import resolve_device

    try:
        return resolve_device(name)
    except ValueError as e:
        raise CLIError(str(e)) from None


def _check_graphs(graphs: bool | None, device) -> bool:
    if graphs and device.type != "cuda":
        raise CLIError("--graphs needs a CUDA device (CUDA graphs); use --no-graphs or run on a GPU")
    return device.type == "cuda" if graphs is None else graphs


def _train_config(args: argparse.Namespace, device, graphs: bool, out_dir: Path, **overrides: Any):
    from packgraph.train import TrainConfig

    preset = args.preset or "tiny"
    lr = {"tiny": 3e-3, "small": 1e-3, "medium": 6e-4, "large": 3e-4}[preset]
    cfg = TrainConfig(
        preset=preset,
        T=args.T,
        lr=lr,
        seed=args.seed,
        device=str(device),
        graphs=graphs,
        scope=getattr(args, "scope", "layer"),  # demo has --scopes instead
        attention_backend=args.attention_backend,
        max_seqlen_ladder=args.max_seqlen_ladder,
        capacity_ladder=args.capacity_ladder,
        max_docs=args.max_docs,
        out_dir=str(out_dir),
    )
    cfg = dataclasses.replace(cfg, **overrides)
    try:
        return cfg.validate()
    except ValueError as e:
        raise CLIError(str(e)) from None


def _min_chunk_len(args: argparse.Namespace) -> int:
    """``--min-chunk-len``, or 64 capped at ``--chunk-len``: only both flags given can contradict each other."""
    if args.min_chunk_len is not None:
        return args.min_chunk_len
    return min(64, args.chunk_len) if args.chunk_len is not None else 64


def cmd_train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.nproc > 1:
        from packgraph.distributed import launch  # lazily: the single-process path needs no torch.distributed

        # launch's torchrun command drops --nproc itself: the children must not launch again.
        return int(launch(args.nproc, argv) or 0)
    device = _device(args.device)
    graphs = _check_graphs(args.graphs, device)
    if args.resume:
        from packgraph.train import resolve_checkpoint

        try:
            resolve_checkpoint(args.resume)
        except FileNotFoundError as e:
            raise CLIError(str(e)) from None
    out_dir = _out_path(args, "train")
    overrides: dict[str, Any] = dict(
        steps=args.steps,
        grad_accum=args.grad_accum,
        dp_engine=args.dp_engine,
        warmup_steps=args.warmup if args.warmup is not None else min(100, args.steps // 10),
        chunk_len=args.chunk_len,
        min_chunk_len=_min_chunk_len(args),
        resume=args.resume,
        checkpoint_every=args.checkpoint_every,
        progress=not args.no_progress,
        plot=not args.no_plot,
        deterministic=args.deterministic,
        log_every=args.log_every,
    )
    if args.lr is not None:
        overrides["lr"] = args.lr
    cfg = _train_config(args, device, graphs, out_dir, **overrides)
    from packgraph.train import train

    # Under torchrun (packgraph train --nproc N) only rank 0 writes and talks; every rank has checked the out dir.
    main_rank = int(os.environ.get("RANK", "0")) == 0

    def prepare() -> None:  # once the config and any checkpoint are checked: a refused run deletes nothing
        _make_dir(out_dir, "train", args)
        print(f"out dir: {out_dir}")

    try:
        result = train(cfg, prepare_out_dir=prepare)
    except (ValueError, FileNotFoundError) as e:  # a bad config, resume point or checkpoint: a user error
        raise CLIError(str(e)) from None
    if not main_rank:
        return 0
    n = max(1, min(10, len(result.losses) // 5))
    print(
        f"final loss {result.final_loss:.4f} (first {result.losses[0]:.4f}; mean of last {n} "
        f"{sum(result.losses[-n:]) / n:.4f}); {result.tokens_per_s:,.0f} tokens/s steady "
        f"({result.tokens_per_s_overall:,.0f} over all steps, captures included); "
        f"median step {result.step_ms_median:.1f} ms; graph sets {result.num_graph_sets}, "
        f"recaptures {result.recaptures}"
    )
    print(f"log: {result.log_path}")
    if result.checkpoint_path:
        print(f"checkpoint: {result.checkpoint_path}")
    if result.plot_path:
        print(f"plot: {result.plot_path}")
    return 0


def cmd_demo(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from packgraph.train.demo import demo_settings, run_demo

    device = _device(args.device)
    graphs = _check_graphs(args.graphs, device)
    out_dir = _out_path(args, "demo")
    settings = demo_settings(
        device, preset=args.preset, T=args.T, steps=args.steps, max_docs=args.max_docs, fast=args.fast
    )
    args.preset, args.T = settings.pop("preset"), settings.pop("T")  # _train_config reads them (the lr per preset)
    cfg = _train_config(args, device, False, out_dir, **settings)
    _make_dir(out_dir, "demo", args)
    run_demo(cfg, scopes=args.scopes if graphs else (), echo=print)
    return 0


def _load_model(args: argparse.Namespace, device, attention_backend: str = "flash"):
    import torch

    from packgraph.models.gpt import GPT, GPTConfig
    from packgraph.train import load_checkpoint, resolve_checkpoint
    from packgraph.train.checkpoint import check_model_state

    if args.checkpoint:
        try:
            path = resolve_checkpoint(args.checkpoint)
            ckpt = load_checkpoint(path)  # data only: a file that would run code is refused
        except (FileNotFoundError, ValueError) as e:
            raise CLIError(str(e)) from None
        try:
            # The attention backend is no weight: the checkpoint's model runs on the one asked for.
            model = GPT(GPTConfig(**{**ckpt["model_config"], "attention_backend": attention_backend}))
        except Exception as e:  # a foreign file that happens to have the keys
            raise CLIError(f"{path} is not a packgraph checkpoint ({type(e).__name__}: {e})") from None
        try:
            check_model_state(ckpt["model"], model)  # names missing, unexpected and misshapen tensors on one line
        except ValueError as e:
            raise CLIError(f"{path}: {e}") from None
        model.load_state_dict(ckpt["model"])
        saved = ckpt.get("train_config")
        preset = saved.get("preset") if isinstance(saved, dict) else None
        if args.preset and preset and args.preset != preset:
            raise CLIError(f"--preset {args.preset} does not match the checkpoint's model")
        return model.to(device), str(path)
    torch.manual_seed(args.seed)
    return GPT(GPTConfig.preset(args.preset or "tiny", attention_backend=attention_backend)).to(device), None


def cmd_score(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import itertools

    import torch

    from packgraph.data.stream import DataStream, corpus_documents
    from packgraph.score import score
    from packgraph.train.logs import atomic_open, write_text_atomically

    device = _device(args.device)
    graphs = _check_graphs(args.graphs, device)
    out_dir = _out_path(args, "score")
    cfg = _train_config(args, device, graphs, out_dir, max_docs=args.max_docs or 100).resolved(device, print)
    model, source = _load_model(args, device, cfg.attention_backend)
    _make_dir(out_dir, "score", args)
    print(f"packgraph score on {device}; model {source or 'fresh init (seed ' + str(args.seed) + ')'}")
    print(f"out dir: {out_dir}")
    data = DataStream(corpus_documents(cfg), T=cfg.T, policy=cfg.bucket_policy(), seed=cfg.seed)
    batches = list(itertools.islice(data, args.batches))
    result = score(model, batches, graphed=graphs, scope=args.scope)
    print(
        f"{len(batches)} batches of T={cfg.T}, {result.target_tokens} target tokens: mean logprob "
        f"{result.mean_logprob:.4f} (perplexity {torch.tensor(-result.mean_logprob).exp().item():.2f})"
    )
    print(f"eager {result.eager_ms:.2f} ms/batch")
    if graphs:
        print(
            f"graphed (forward-only, scope {args.scope}) {result.graphed_ms:.2f} ms/batch, speedup "
            f"{result.speedup:.2f}x; max |logprob graphed - eager| = {result.max_abs_diff:.3e}"
        )
    elif device.type != "cuda":
        print("(no CUDA here: eager logprobs only; graphs need a GPU)")
    summary = {
        "device": str(device),
        "model": source,
        "batches": len(batches),
        "T": cfg.T,
        "target_tokens": result.target_tokens,
        "mean_logprob": result.mean_logprob,
        "eager_ms": result.eager_ms,
        "graphed_ms": result.graphed_ms,
        "max_abs_diff": result.max_abs_diff,
        "scope": args.scope if graphs else None,
    }
    write_text_atomically(out_dir / "score.json", json.dumps(summary, indent=2) + "\n")
    if args.save_logprobs:
        with atomic_open(out_dir / "logprobs.pt") as f:
            torch.save({"logprobs": result.logprobs, "eager_logprobs": result.eager_logprobs}, f)
    return 0


def cmd_plot_convergence(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from packgraph.train.logs import convergence_report, plot_losses, read_log, text_table, write_text_atomically

    if args.labels and len(args.labels) != len(args.logs):
        raise CLIError(f"--labels has {len(args.labels)} names for {len(args.logs)} logs")
    if not 0 <= args.ema < 1:
        raise CLIError(f"--ema must be in [0, 1), got {args.ema}")
    labels = args.labels or [Path(p).resolve().parent.name or str(p) for p in args.logs]
    if len(set(labels)) != len(labels):
        labels = [str(p) for p in args.logs]
    logs = {}
    for label, path in zip(labels, args.logs, strict=True):
        try:
            logs[label] = read_log(path)
        except (FileNotFoundError, ValueError) as e:
            raise CLIError(str(e)) from None
    report = convergence_report(logs, beta=args.ema)
    out = Path(args.out)
    if out.is_dir():
        raise CLIError(f"--out {out} is a directory; give a .png file name")
    blocking = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise CLIError(f"--out {out}: {blocking} is a file, not a directory")
    curves = {n: [(int(r["step"]), float(r["loss"])) for r in rows] for n, rows in logs.items()}
    png = plot_losses(curves, out, echo=print, beta=args.ema)
    out.with_suffix(".json").parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(out.with_suffix(".json"), json.dumps(report, indent=2) + "\n")
    rows = [
        [
            n,
            f"{report['first_loss'][n]:.4f}",
            f"{report['final_loss'][n]:.4f}",
            f"{report['tokens_per_s'][n]:,.0f}",
            "ref" if n == report["reference"] else f"{report['max_rel_diff'][n]:.3%}",
        ]
        for n in logs
    ]
    print(text_table(rows, ["run", "first loss", "final loss", "tokens/s steady", "max rel diff (EMA)"]))
    print(f"{report['common_steps']} common steps; EMA beta {args.ema}")
    if png:
        print(f"plot: {png}")
    print(f"summary: {out.with_suffix('.json')}")
    return 0


def _bench(argv: Sequence[str]) -> int:
    try:
        from packgraph.bench import main as bench_main
    except ImportError as e:
        raise CLIError(f"the bench command is not available in this install ({e})") from None
    try:
        return int(bench_main(list(argv)) or 0)
    except SystemExit as e:  # its argparse printed the usage and the error
        return int(e.code or 0)


COMMANDS = {"demo": cmd_demo, "train": cmd_train, "score": cmd_score, "plot-convergence": cmd_plot_convergence}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``packgraph`` console script. Returns the exit code (0 ok, 2 user error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # bench owns its flags: hand everything after the word over untouched.
        if argv and argv[0] == "bench":
            return _bench(argv[1:])
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # argparse already printed usage and the error (or the help)
            return int(e.code or 0)
        return COMMANDS[args.command](args, argv[1:])
    except CLIError as e:
        print(f"packgraph: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:
        # Raised by config and data checks (bad ladders, a document no bucket fits, a missing file).
        if os.environ.get("PACKGRAPH_DEBUG"):
            raise
        print(f"packgraph: error: {e} (set PACKGRAPH_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("packgraph: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
