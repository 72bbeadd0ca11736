"""Measure the top capacity rung of ``default_buckets``: FA2 varlen fwd+bwd of many-document batches.

A batch of more documents than the 512 rung holds (many one-token documents, say) needs a larger capacity. This
times ``varlen_attention`` forward+backward (CUDA-graph replays, CUDA events, median of 50) at T in {2048, 4096,
8192} for such batches under three capacities: the exact document count (eager's choice), the next rung of a x4
ladder continued past 512, and T (the most documents T rows can hold). Writes ``capacity_rung.json`` into the out
dir; run on a GPU: ``python3 bench/capacity_rung.py OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from packgraph.bench.attention import time_attention
from packgraph.bench.machine import machine_info
from packgraph.params import PackedSeqParams


def _x4_rung(n: int, T: int) -> int:
    rung = 512
    while rung < n:
        rung *= 4
    return min(rung, T)


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    rows = []
    heads, head_dim = 8, 64
    for T in (2048, 4096, 8192):
        for n in sorted({513, 600, 1000, T // 2, T - 1, T}):
            if n > T:
                continue
            lengths = [T // n] * n  # n documents covering the stream (one token each when n == T)
            q, k, v = (
                torch.randn(T, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(3)
            )
            row = {"T": T, "docs": n, "doc_len": T // n}
            for name, capacity in (("exact", n), ("x4", _x4_rung(n, T)), ("T", T)):
                params = PackedSeqParams.from_seqlens(
                    lengths, capacity=capacity, total_tokens=T, max_seqlen=256, device="cuda"
                ).attention_view()
                row[f"{name}_capacity"] = capacity
                row[f"{name}_ms"] = time_attention(q, k, v, params, reps=50)
            rows.append(row)
            print(row, flush=True)
    meta = {
        **machine_info(torch.device("cuda")),
        "heads": heads,
        "head_dim": head_dim,
        "max_seqlen": 256,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity_rung.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out")
