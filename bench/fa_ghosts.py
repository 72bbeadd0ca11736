"""What ghost slots cost FlashAttention-2 varlen, and what a backward split over slot chunks saves.

Two measurements on one GPU (CUDA-graph replays, CUDA events, median of ``--reps``), written as ``fa_ghosts.json``:

* ``few_docs``: batches of one to three documents under the capacity a static bucket gives them (1, 2, 8) and
  under their exact count, forward alone and forward + backward, at the exact and at the bucket's max_seqlen.
* ``chunked_bwd``: many-document batches (one document near the max_seqlen rung, the rest one token) at their
  exact count and at the 2048-slot rung: the backward's peak memory and time when FA2's backward runs once over
  all slots, and when it runs once per chunk of ``G`` slots (its fp32 dq accumulator holds
  ``total_q + 128 x slots`` rows, so a chunk bounds it). The dq/dk/dv of live rows are compared with the
  one-call backward.

Run on a GPU: ``python3 bench/fa_ghosts.py OUT_DIR``.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
from pathlib import Path

import torch

from packgraph.bench.attention import graph_replay_ms
from packgraph.bench.machine import machine_info

FWD = torch.ops.aten._flash_attention_forward
BWD = torch.ops.aten._flash_attention_backward


def _cu(lengths: list[int], capacity: int) -> torch.Tensor:
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    offs += [offs[-1]] * (capacity - len(lengths))
    return torch.tensor(offs, dtype=torch.int32, device="cuda")


def _median_ms(fn, reps: int) -> float:
    return statistics.median(graph_replay_ms(fn, torch.device("cuda"), reps=reps))


def _fwd(q, k, v, cu, max_s):
    return FWD(q, k, v, cu, cu, max_s, max_s, 0.0, True, False)


def _bwd(dout, q, k, v, out, lse, rng, unused, cu, max_s, chunk: int | None):
    cap = cu.numel() - 1
    if chunk is None or chunk >= cap:
        return BWD(dout, q, k, v, out, lse, cu, cu, max_s, max_s, 0.0, True, rng, unused)
    rows = torch.arange(q.shape[0], device=q.device)
    dq = dk = dv = None
    for s in range(0, cap, chunk):
        sub = cu[s : min(s + chunk, cap) + 1]
        gq, gk, gv = BWD(dout, q, k, v, out, lse, sub, sub, max_s, max_s, 0.0, True, rng, unused)
        mine = ((rows >= sub[0]) & (rows < sub[-1]))[:, None, None]
        parts = [torch.where(mine, g, 0) for g in (gq, gk, gv)]
        dq, dk, dv = parts if dq is None else (dq + parts[0], dk + parts[1], dv + parts[2])
    return dq, dk, dv


def few_docs(reps: int) -> list[dict]:
    rows = []
    for T, heads, dim in ((2048, 8, 64), (4096, 8, 64), (4096, 16, 64), (8192, 16, 64)):
        q, k, v = (torch.randn(T, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        dout = torch.randn_like(q)
        for lengths in ([T - 60], [T], [T // 2 + 200, T // 2 - 300], [T // 3] * 3):
            for capacity in sorted(c for c in {len(lengths), 2, 8} if c >= len(lengths)):
                for max_s in sorted({max(lengths), T}):
                    cu = _cu(lengths, capacity)
                    out, lse, rng, unused, _ = _fwd(q, k, v, cu, max_s)
                    row = {"T": T, "heads": heads, "lengths": lengths, "capacity": capacity, "max_seqlen": max_s}
                    row["fwd_ms"] = _median_ms(functools.partial(_fwd, q, k, v, cu, max_s), reps)
                    bwd = functools.partial(_bwd, dout, q, k, v, out, lse, rng, unused, cu, max_s, None)
                    row["bwd_ms"] = _median_ms(bwd, reps)
                    rows.append(row)
                    print(row, flush=True)
    return rows


def chunked_bwd(reps: int) -> list[dict]:
    rows = []
    T, heads, dim, max_s = 2048, 8, 64, 256
    q, k, v = (torch.randn(T, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn_like(q)
    for n in (129, 545, 1025, 2048):
        lengths = [min(max_s, T - (n - 1))] + [1] * (n - 1)
        for capacity in sorted({n, 2048} | ({1024} if n <= 1024 else set())):
            cu = _cu(lengths, capacity)
            out, lse, rng, unused, _ = _fwd(q, k, v, cu, max_s)
            ref = _bwd(dout, q, k, v, out, lse, rng, unused, cu, max_s, None)
            live = (torch.arange(T, device="cuda") < cu[-1])[:, None, None]
            for chunk in (None, 128, 256, 512):
                if chunk is not None and chunk >= capacity:
                    continue
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                got = _bwd(dout, q, k, v, out, lse, rng, unused, cu, max_s, chunk)
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
                diff = max(
                    float((torch.where(live, g, 0) - torch.where(live, r, 0)).abs().max())
                    for g, r in zip(got, ref, strict=True)
                )
                ms = _median_ms(functools.partial(_bwd, dout, q, k, v, out, lse, rng, unused, cu, max_s, chunk), reps)
                row = {
                    "docs": n,
                    "capacity": capacity,
                    "chunk": chunk,
                    "bwd_peak_mib": peak / 2**20,
                    "bwd_ms": ms,
                    "max_abs_diff_vs_one_call": diff,
                }
                rows.append(row)
                print(row, flush=True)
    return rows


def main(out_dir: str, reps: int = 50) -> None:
    torch.manual_seed(0)
    print(FWD.default._schema, BWD.default._schema, sep="\n", flush=True)
    result = {
        **machine_info(torch.device("cuda")),
        "reps": reps,
        "few_docs": few_docs(reps),
        "chunked_bwd": chunked_bwd(reps),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fa_ghosts.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
