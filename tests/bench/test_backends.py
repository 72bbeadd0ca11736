"""``packgraph bench --backends`` on the CPU: the rows it writes, and the useful-work count its TFLOP/s divide."""

import json

import pytest
import torch

from packgraph import slot_boundary
from packgraph.bench.backends import FLEX_TILES, causal_flops, short_docs_switch, switch_doc_counts, switch_packing
from packgraph.bench.run import main


def test_causal_flops_counts_the_visible_pairs_of_each_document():
    lengths, heads, head_dim = [5, 1, 12, 0, 7], 3, 8
    visible = 0
    for n in lengths:  # a naive count: each query sees itself and the keys before it in its document
        mask = torch.ones(n, n).tril()
        visible += int(mask.sum())
    assert causal_flops(lengths, heads, head_dim) == 4 * head_dim * heads * visible


def test_the_cli_measures_every_backend_or_names_why_not(tmp_path):
    code = main(["--backends", "--device", "cpu", "--T", "64", "--mixes", "short", "--head-dims", "16",
                 "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    doc = json.loads((tmp_path / "backends.json").read_text())
    assert doc["machine"]["device"] == "cpu"
    rows = doc["rows"]
    by = {(r["packing"], r["backend"]): r for r in rows}
    assert {b for _, b in by} == {"flash", "fa2-op", "fa2-op-exact", "doc_mask", "doc_mask-kernel"} and len(rows) == 10
    for packing in (0, 1):
        flash = by[(packing, "flash")]  # the exact reference on the CPU: forward and backward
        assert flash["fwd_ms"] > 0 and flash["fwdbwd_ms"] > 0 and flash["first_s"] > 0
        assert flash["fwd_tflops"] == flash["causal_gflop"] * 1e9 / (flash["fwd_ms"] * 1e9)
        assert "CUDA only" in by[(packing, "fa2-op")]["error"] and by[(packing, "fa2-op")]["fwd_tflops"] is None
        doc_mask = by[(packing, "doc_mask")]  # FlexAttention: forward only on the CPU
        assert doc_mask["fwd_ms"] > 0 and "forward passes only on the CPU" in doc_mask["error"]
        kernel = by[(packing, "doc_mask-kernel")]  # torch's own refusal: no FlexAttention backward on the CPU
        assert kernel["fwd_ms"] > 0 and "backward on CPU" in kernel["error"]
    sweep = doc["sweep"]  # one packing of the corpus mix at T=64: max_seqlen 64 only, capacity doubling to 512
    flash = [r for r in sweep if r["backend"] == "flash"]
    assert [(r["axis"], r["declared_max"], r["capacity"]) for r in flash] == [("max_seqlen", 64, 1)] + [
        ("capacity", 64, c) for c in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    ]
    assert all(r["fwdbwd_ms"] > 0 for r in flash)
    assert [r["axis"] for r in sweep if r["backend"] == "doc_mask"] == ["none"]
    assert doc["switch"] == []  # T=64 holds no bucket of 129 documents
    tiles = doc["tiles"]  # at the largest T (none >= 8192): flash, then each tile choice, per mix
    assert [(r["mix"], r["backend"], r["tiles"]) for r in tiles] == [
        (mix, backend, name)
        for mix in ("corpus", "long", "short")
        for backend, name in [("flash", "-"), *(("doc_mask-kernel", name) for name in FLEX_TILES)]
    ]
    for r in tiles:
        assert r["fwd_ms"] > 0 and r["T"] == 64 and r["head_dim"] == 16
        assert r["fwdbwd_ms"] > 0 if r["backend"] == "flash" else "backward on CPU" in r["error"]
    table = (tmp_path / "backends.md").read_text()
    assert table.count("\n") == 2 + len(rows) + 3 + 2 + len(sweep) + 3 + 2 + len(tiles)
    assert "doc_mask-kernel" in table and "fwd 64x64 w4 s3, bwd 32x64 w4 s3" in table


def test_the_cli_takes_the_packing_count_and_skips_the_tile_study(tmp_path):
    code = main(["--backends", "--device", "cpu", "--T", "64", "--mixes", "short", "--head-dims", "16",
                 "--packings", "1", "--no-tiles", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    doc = json.loads((tmp_path / "backends.json").read_text())
    assert {r["packing"] for r in doc["rows"]} == {0} and len(doc["rows"]) == 5 and doc["tiles"] == []


def test_the_tile_plot_draws_each_timed_choice_and_skips_failed_ones(tmp_path):
    from packgraph.bench.plots import plot_tiles

    rows = [
        dict(T=8192, mix=mix, head_dim=d, backend=backend, tiles=tiles, fwdbwd_ms=ms)
        for d in (64, 128)
        for mix in ("corpus", "short")
        for backend, tiles, ms in [("flash", "-", 2.0), ("doc_mask-kernel", "a", 1.5), ("doc_mask-kernel", "b", 2.5)]
    ] + [dict(T=8192, mix="corpus", head_dim=64, backend="doc_mask-kernel", tiles="c", error="OutOfResources")]
    path = plot_tiles(rows, tmp_path / "tiles.png")
    assert path == tmp_path / "tiles.png" and path.stat().st_size > 10_000
    failed_only = [r for r in rows if "error" in r]
    assert plot_tiles(failed_only, tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


@pytest.mark.parametrize("T,docs", [(512, 128), (8192, 129), (8192, 2048), (32768, 8192), (4096, 1)])
@pytest.mark.parametrize("shape", ["even", "one-long"])
def test_a_switch_packing_holds_the_documents_asked_in_T_rows(T, docs, shape):
    lengths = switch_packing(T, docs, shape, seed=3)
    assert len(lengths) == docs and min(lengths) >= 1 and sum(lengths) <= T
    if shape == "one-long":
        assert lengths[0] == T // 4 and max(lengths[1:], default=0) < T // 4
    assert switch_packing(T, docs, shape, seed=3) == lengths  # the seed fixes it


def test_the_switch_counts_start_at_the_switch_and_stay_within_a_quarter_of_T():
    assert switch_doc_counts(64) == []
    assert switch_doc_counts(8192) == [slot_boundary.DEFAULT, 256, 512, 1024, 2048]


def test_the_switch_study_times_both_settings_on_each_bucket():
    """On the CPU both settings run the exact reference (short_docs is a CUDA path): the rows' shape is what is
    checked here, and that the bucket holds the documents with the switch on for one setting only."""
    rows = short_docs_switch(1024, [16], doc_counts=[129, 200], heads=2, kv_heads=1, reps=1, device="cpu")
    assert [(r["shape"], r["docs"]) for r in rows] == [(s, n) for s in ("even", "one-long") for n in (129, 200)]
    for r in rows:
        assert r["capacity"] >= r["docs"] and r["short_docs_min_slots"] == slot_boundary.DEFAULT_MIN_SLOTS
        assert r["short_ms"] > 0 and r["fa2_ms"] > 0 and r["short_over_fa2"] == r["short_ms"] / r["fa2_ms"]
        assert r["T"] == 1024 and r["head_dim"] == 16 and r["max_seqlen"] >= r["longest"]
