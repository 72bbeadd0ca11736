"""What a bucket ladder costs in ghost slots and empty FlashAttention blocks, counted on the host (no GPU).

    python3 bench/ladder_ghosts.py [--batches 201] [--out DIR]

For the benchmark's streams (``packgraph.bench.data.batch_stream``: corpus, short and long mixes at T=2048 and
8192, and the bucket tour, which each ladder builds for itself), under the ladders of ``packgraph bench
--ladder`` (the default and two finer ones):

* ``buckets``: the buckets the stream visits, one capture each;
* ``capture ghosts``: the most ghost slots (the bucket's capacity over the batch's documents) in a batch that
  captures a bucket, and what they add to FA2's backward buffers at that capture (``128 x slots`` rows of the fp32
  dq accumulator and softmax sums, at most 512 slots per call, for 8 heads of 64: the ``small`` model). A capture
  step's allocated peak holds them on top of what eager's holds
  (``bench/results/2026-12-01-h200-gpu-check-stack/NOTES.md``);
* ``grid / eager``: FA2's forward grid over the stream, ``ceil(max_seqlen / 128) x slots`` blocks per batch (per
  head), against eager's at the batch's true max_seqlen and document count. Empty blocks still cost GPU time;
* ``empty blocks``: the same grids as a difference, blocks per head per batch beyond eager's. What an empty block
  costs is fixed (it is scheduled, then exits), so the difference, not the ratio, is what adds time: a small
  bucket may have several times eager's grid and still add nothing measurable;
* ``longest alone``: those blocks if the longest document ran in an attention call of its own at the bucket's
  max_seqlen, and the other ``capacity - 1`` slots in a second call at the ladder's max_seqlen rung above the
  second-longest document (a static rung more in the signature: ``graphs`` counts the signatures then).

The default of 201 batches is the length of the streams ``packgraph bench --standard`` builds (``max(steps,
graph_batches) + 1``): ``batch_stream`` draws a different stream for each length, so counts over another length
describe other batches.

These are counts, not timings: what a ladder does to step time and memory is for the benchmark to measure.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from packgraph.bench.data import batch_stream
from packgraph.bench.presets import LADDERS, ladder_policy
from packgraph.bench.report import write_table
from packgraph.buckets import BucketPolicy
from packgraph.ops.flash_chunks import SLOTS_PER_BACKWARD, backward_bytes_per_slot

MiB = 2**20
HEADS, HEAD_DIM = 8, 64  # the small model


def ladders(T: int) -> dict[str, BucketPolicy]:
    return {name: ladder_policy(name, T) for name in LADDERS}


def _accum_bytes(slots: int) -> int:
    return min(slots, SLOTS_PER_BACKWARD) * backward_bytes_per_slot(HEADS, HEAD_DIM)


def _blocks(max_seqlen: int, slots: int) -> int:
    """FA2's forward grid per head: one block per 128 rows of max_seqlen per slot."""
    return math.ceil(max_seqlen / 128) * slots


def _rung_above(ladder: Sequence[int], length: int) -> int:
    return next(r for r in ladder if r >= length)


def count(stream: Sequence, policy: BucketPolicy) -> dict:
    seen: dict[tuple[int, int], int] = {}
    split_signatures: set[tuple[int, int, int]] = set()
    grid = grid_eager = grid_split = batches = 0
    for b in stream:
        lengths = sorted(b.doc_lengths)
        n, longest = len(lengths), b.packed_seq_params.max_seqlen_q
        bucket = policy.bucket_for(longest, n)
        seen.setdefault((bucket.max_seqlen, bucket.capacity), n)
        grid += _blocks(bucket.max_seqlen, bucket.capacity)
        grid_eager += _blocks(max(longest, 1), max(n, 1))
        rest = _rung_above(policy.max_seqlen_ladder, lengths[-2]) if n > 1 else 0
        grid_split += _blocks(bucket.max_seqlen, 1) + _blocks(rest, bucket.capacity - 1)
        split_signatures.add((bucket.max_seqlen, bucket.capacity, rest))
        batches += 1
    ghosts = max(c - n for (_, c), n in seen.items())
    extra = max(_accum_bytes(c) - _accum_bytes(n) for (_, c), n in seen.items())
    return dict(
        buckets=len(seen),
        capture_ghosts=ghosts,
        capture_extra_mib=extra / MiB,
        grid_over_eager=grid / grid_eager,
        empty_blocks=(grid - grid_eager) / batches,
        empty_blocks_longest_alone=(grid_split - grid_eager) / batches,
        graphs_longest_alone=len(split_signatures),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=201)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows = []
    for T in (2048, 8192):
        for name, policy in ladders(T).items():
            for mix in ("corpus", "short", "long", "buckets"):
                stream = batch_stream(mix, T, args.batches, policy=policy)
                rows.append(dict(T=T, ladder=name, mix=mix, **count(stream, policy)))
    lines = [
        "| T | ladder | mix | buckets | most ghost slots at a capture | their FA2 bwd buffers (MiB) | grid / eager "
        "| empty blocks | longest alone: empty blocks | longest alone: graphs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['T']} | {r['ladder']} | {r['mix']} | {r['buckets']} | {r['capture_ghosts']} | "
            f"{r['capture_extra_mib']:.1f} | {r['grid_over_eager']:.2f} | {r['empty_blocks']:.0f} | "
            f"{r['empty_blocks_longest_alone']:.0f} | {r['graphs_longest_alone']} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        meta = dict(batches=args.batches, host="CPU, no GPU")
        meta["ladders"] = {
            T: {k: [list(v.max_seqlen_ladder), list(v.capacity_ladder)] for k, v in ladders(T).items()}
            for T in (2048, 8192)
        }
        write_table(args.out, "ladder_ghosts", table, rows, meta)


if __name__ == "__main__":
    main()
