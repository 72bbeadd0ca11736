"""Bucket ladders replayed over attention measurements, and the recommended one."""

import pytest

from packgraph.bench.attention import evaluate_ladders, recommend_ladder


def test_ladder_evaluation_and_recommendation():
    # one packing per mix at T=1024; ratios chosen so that a coarse ladder is slow on the short mix. The ladders
    # are taken as given (switch off): short_docs' boundary rung (slot_boundary.with_boundary_rung) is tested on
    # its own.
    rows = []

    def add(mix, true_max, num_seqs, points):
        for (max_seqlen, capacity), ratio in points.items():
            rows.append(
                dict(
                    T=1024,
                    mix=mix,
                    head_dim=64,
                    heads=16,
                    packing=0,
                    num_seqs=num_seqs,
                    true_max=true_max,
                    max_seqlen=max_seqlen,
                    capacity=capacity,
                    ms=ratio,
                    ratio=ratio,
                )
            )

    add("short", 100, 20, {(100, 20): 1.0, (128, 32): 1.02, (256, 32): 1.05, (1024, 32): 1.6, (1024, 512): 3.0})
    add("long", 1000, 2, {(1000, 2): 1.0, (1024, 2): 1.005, (1024, 8): 1.01, (1024, 32): 1.03, (1024, 512): 1.4})
    summary = {s["ladder"]: s for s in evaluate_ladders(rows, short_docs_min_slots=None)}
    default = summary["default"]  # max_seqlen (256, 1024) x capacity (8, 32, 128, 512): long runs at (1024, 8)
    assert default["worst_ratio_by_mix"] == {"short": 1.05, "long": 1.01}
    assert default["worst_ratio"] == 1.05 and default["mean_ratio"] == pytest.approx((1.05 + 1.01) / 2)
    naive = summary["max_seqlen T / capacity 512"]
    assert naive["buckets"] == 1 and naive["worst_ratio"] == 3.0
    # a candidate whose rung was never measured reports it instead of guessing
    assert summary["max_seqlen x2 from 64 / capacity x4 from 8"]["missing"] == 0
    assert summary["max_seqlen x4 from 256 / capacity 512"]["missing"] == 1  # (256, 512) for short: not measured
    # fewest buckets within 1.10x: max_seqlen (256, 1024) x capacity (32, 512) -> short (256, 32) 1.05,
    # long (1024, 32) 1.03; every 2-bucket ladder needs (1024, *) for the short mix (>= 1.6)
    best = recommend_ladder(summary.values(), limit=1.10)[1024]
    assert best["ladder"] == "max_seqlen x4 from 256 / capacity 32,512"
    assert best["buckets"] == 4 and best["worst_ratio"] == 1.05
    assert recommend_ladder(summary.values(), limit=1.0)[1024] is None
