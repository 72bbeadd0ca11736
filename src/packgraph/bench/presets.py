"""The presets of ``packgraph bench``: which cells, methods and attention sweep a run measures, and for how long.

``quick`` is what ``scripts/gpu-check`` runs; ``standard`` the committed H200 run; ``full`` the issue's whole
matrix; ``dry-run`` a tiny CPU matrix that exercises the harness end to end. A preset either names a grid
(``models`` x ``T`` x ``mixes``, each cell with every one of ``methods``) or lists its ``cells`` as
``[model, T, mix, methods]``.
"""

from __future__ import annotations

from typing import Any

from packgraph.bench.data import MIXES
from packgraph.bench.methods import METHODS
from packgraph.buckets import BucketPolicy, default_buckets, geometric_ladder

__all__ = ["LADDERS", "PRESETS", "ladder_policy"]

LADDERS: tuple[str, ...] = ("default", "capacity-x2", "both-x2")
"""The bucket ladders ``packgraph bench --ladder`` can measure under (see :func:`ladder_policy`)."""


def ladder_policy(name: str, T: int) -> BucketPolicy:
    """The bucket policy of ``--ladder name`` at ``T`` tokens: ``default`` is :func:`~packgraph.default_buckets`;
    ``capacity-x2`` keeps its max_seqlen rungs with capacity rungs 8, 16, 32, ..., T (and 1 first up to T=2048,
    as the default); ``both-x2`` also takes max_seqlen rungs 256, 512, ..., T. The finer ladders put fewer ghost
    slots and less max_seqlen slack in each batch, for more buckets (docs/buckets.md counts both).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in LADDERS:
        raise ValueError(f"unknown ladder {name!r}; choose from {', '.join(LADDERS)}")
    default = default_buckets(T)
    if name == "default":
        return default
    lone = (1,) if 1 in default.capacity_ladder else ()  # the default's rung of 1, where it has one
    capacities = tuple(sorted({*lone, *geometric_ladder(8, T, 2)}))
    seqlens = default.max_seqlen_ladder if name == "capacity-x2" else geometric_ladder(256, T, 2)
    return BucketPolicy(seqlens, capacities)


PRESETS: dict[str, dict[str, Any]] = {
    "quick": dict(
        models=["small"],
        T=[2048],
        mixes=["corpus"],
        methods=["eager", "padded", "packgraph", "packgraph-model", "compile-ro", "compile-ro-raw"],
        steps=20,
        warmup=3,
        graph_batches=50,
        graph_budget_s=10.0,
        attention=dict(T=[8192], mixes=["corpus", "short"], head_dims=[64, 128], heads=16, packings=3, reps=5),
        max_corpus_docs=None,
    ),
    "full": dict(
        models=["small", "medium", "large"],
        T=[2048, 8192, 16384],
        mixes=list(MIXES),
        methods=list(METHODS),
        steps=20,
        warmup=3,
        graph_batches=200,
        graph_budget_s=60.0,
        attention=dict(T=[8192, 16384], mixes=list(MIXES), head_dims=[64, 128], heads=16, packings=6, reps=10),
        max_corpus_docs=None,
    ),
    # The committed H200 run (one invocation, under 10 minutes): every method where the reference figures are
    # (small T=2048, medium T=8192), the packed methods on every mix. Cells run in this order, the ones the targets
    # need first, so that a slow host's time limit cuts the tail. The large model, T=16384 attention and
    # compile-ro-raw (a recompile per new shape) are in --full only: with them the run passes 10 minutes
    # (docs/bench.md).
    "standard": dict(
        methods=list(METHODS),
        cells=[
            ["small", 2048, "corpus", [m for m in METHODS if m != "compile-ro-raw"]],
            # the GPU-bound cell: the compiled whole model captured by packgraph against compile-RO, and the
            # document-mask backend, alone and compiled (issue #36's goals: its step against compile-RO, its peak
            # against eager's)
            [
                "medium",
                8192,
                "corpus",
                [
                    "eager",
                    "packgraph",
                    "packgraph-model+compile",
                    "packgraph-docmask",
                    "packgraph-docmask-model+compile",
                    "compile-ro",
                ],
            ],
            ["small", 2048, "short", ["eager", "padded", "packgraph", "packgraph-model"]],
            ["small", 2048, "long", ["eager", "padded", "packgraph", "packgraph-model"]],
            ["small", 8192, "corpus", ["eager", "padded", "packgraph"]],
            # a stream that visits every bucket of the ladder: memory and captures at their worst; the document
            # mask needs one graph set for all of it
            ["small", 2048, "buckets", ["eager", "packgraph", "packgraph-model", "packgraph-docmask"]],
        ],
        steps=20,
        warmup=3,
        graph_batches=200,
        # this budget and the sweep's 2 packings keep the preset within two 10-minute device calls
        # (docs/bench.md)
        graph_budget_s=8.0,
        attention=dict(T=[8192], mixes=list(MIXES), head_dims=[64, 128], heads=16, packings=2, reps=5),
        max_corpus_docs=None,
        # a safety net: units not started by then are recorded as skipped, and the run still writes its table and
        # plots. The preset outgrew one device call (600 s) with the document-mask methods: it runs detached across
        # two (scripts/bench-detached), and its limit is theirs.
        time_limit_s=1100.0,
    ),
    # torch DDP against the explicit all-reduce, world size 1, side by side (docs/distributed.md)
    "ddp": dict(
        methods=["eager", "eager-ddp", "packgraph", "packgraph-ddp", "packgraph-allreduce"],
        cells=[
            ["small", 2048, "corpus", ["eager", "eager-ddp", "packgraph", "packgraph-ddp", "packgraph-allreduce"]],
            ["medium", 8192, "corpus", ["eager", "eager-ddp", "packgraph", "packgraph-ddp", "packgraph-allreduce"]],
        ],
        steps=20,
        warmup=3,
        graph_batches=0,
        graph_budget_s=0.0,
        attention=dict(T=[8192], mixes=["corpus"], head_dims=[64], heads=16, packings=1, reps=1),
        max_corpus_docs=None,
        time_limit_s=550.0,
    ),
    "dry-run": dict(
        models=["tiny"],
        T=[128],
        mixes=["corpus", "short"],
        methods=["eager", "padded"],
        steps=3,
        warmup=1,
        graph_batches=0,
        graph_budget_s=0.0,
        attention=dict(T=[128], mixes=["short"], head_dims=[16], heads=2, packings=2, reps=2),
        max_corpus_docs=48,
    ),
}
