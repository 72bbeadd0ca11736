"""A/B of ``packgraph.graphs.on_graph_stream`` for the benchmark's ``packgraph`` method (scope "layer"), in one run.

Variant ``capture-stream`` is the library as it is: ``GraphedGPT`` runs the embedding, head and loss on the capture
group's stream. Variant ``caller-stream`` replaces ``on_graph_stream`` by a plain call (everything on the caller's
stream, as before the change). For one model, T and mix, on the same batches:

* **memory**: each variant alone from a clean allocator (cuBLAS workspaces cleared), its peak allocated and
  reserved over the timed pool and the graph-count batches, captures included, beside eager's;
* **step time**: both variants built side by side, then ``--rounds`` interleaved rounds of ``--steps`` timed steps
  each (CUDA events); the medians over all rounds, and per round, so host-speed drift shows up in both.

Run on a GPU: ``python3 bench/stream_ab.py OUT_DIR [--model small --T 2048 --mix short]``; writes
``stream_ab.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

import packgraph.graphs.streams as streams
from packgraph.bench.data import batch_stream
from packgraph.bench.machine import machine_info
from packgraph.bench.measure import _timed_steps, release
from packgraph.bench.methods import make_method
from packgraph.buckets import default_buckets
from packgraph.models.gpt import GPT, GPTConfig

MiB = 2**20
CUDA = torch.device("cuda")
VARIANTS = ("capture-stream", "caller-stream")


@contextlib.contextmanager
def _variant(name: str) -> Iterator[None]:
    if name == "capture-stream":
        yield
        return
    kept = streams.on_graph_stream
    streams.on_graph_stream = lambda graphed, fn, *args, **kwargs: fn(*args, **kwargs)
    try:
        yield
    finally:
        streams.on_graph_stream = kept


def _method(name: str, T: int, model_name: str):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(GPTConfig.preset(model_name))
    return make_method(name, model, default_buckets(T), CUDA)


def _memory(variant: str | None, inputs: list, T: int, model_name: str) -> dict[str, float]:
    """Peak allocated / reserved (MiB) of one method alone over ``inputs`` (eager when ``variant`` is None)."""
    release(CUDA)
    torch.cuda.reset_peak_memory_stats()
    with _variant(variant or "capture-stream"):
        method = _method("eager" if variant is None else "packgraph", T, model_name)
        for inp in inputs:
            method.step(method.prepare(inp))
        torch.cuda.synchronize()
    out = {
        "allocated_mib": torch.cuda.max_memory_allocated() / MiB,
        "reserved_mib": torch.cuda.max_memory_reserved() / MiB,
    }
    del method
    release(CUDA)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--model", default="small")
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--mix", default="short")
    p.add_argument("--batches", type=int, default=60, help="batches of the memory phase (captures included)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant and round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("stream_ab: needs a CUDA device", file=sys.stderr)
        return 2
    stream = batch_stream(args.mix, args.T, args.batches, policy=default_buckets(args.T))
    memory = {"eager": _memory(None, stream, args.T, args.model)}
    for v in VARIANTS:
        memory[v] = _memory(v, stream, args.T, args.model)
        print(f"memory {v}: {memory[v]} (eager {memory['eager']})", flush=True)

    pool = stream[: args.steps]
    methods = {}
    for v in VARIANTS:
        with _variant(v):
            m = _method("packgraph", args.T, args.model)
            inputs = [m.prepare(b) for b in pool]
            for inp in inputs:  # captures every bucket of the pool, then one warm pass
                m.step(inp)
            methods[v] = (m, inputs)
    rounds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    all_ms: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for v in VARIANTS if r % 2 == 0 else reversed(VARIANTS):
            m, inputs = methods[v]
            with _variant(v):
                ms = _timed_steps(m, inputs, [k % len(inputs) for k in range(args.steps)])
            rounds[v].append(statistics.median(ms))
            all_ms[v].extend(ms)
        print(f"round {r}: " + ", ".join(f"{v} {rounds[v][-1]:.2f} ms" for v in VARIANTS), flush=True)

    result = {
        "machine": machine_info(CUDA),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "memory_mib": memory,
        "memory_over_eager": {
            v: {k: memory[v][k] / memory["eager"][k] for k in ("allocated_mib", "reserved_mib")} for v in VARIANTS
        },
        "step_ms_median": {v: statistics.median(all_ms[v]) for v in VARIANTS},
        "step_ms_per_round": rounds,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stream_ab.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("memory_over_eager", "step_ms_median")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
