"""The goals (:mod:`packgraph.bench.targets`): verdicts from chosen records and from a dry run."""

from tests.bench.records import busy_split_cell, load_targets, one_cell_records, results_doc

bench_targets = load_targets()


def test_dry_run_has_a_verdict_for_every_target(dry_run):
    out, _, _ = dry_run
    verdicts = bench_targets.check_targets(out / "results.json")
    assert len(verdicts) >= 9 and all(t["met"] in (True, False, None) for t in verdicts)


def test_targets_from_results():
    doc = results_doc(one_cell_records())
    targets = {t["target"]: t for t in bench_targets.check_targets(doc)}
    assert targets["small, T<=4096: packgraph step <= 1.15x GPU-busy"]["met"] is True
    assert targets["small, T<=4096: packgraph-model step <= 1.05x GPU-busy"]["met"] is False
    assert "1.11x" in targets["small, T<=4096: packgraph-model step <= 1.05x GPU-busy"]["detail"]
    assert targets["GPU-busy under default buckets <= 1.02x eager's (true max_seqlen)"]["met"] is False  # 4.5 / 4.0
    assert targets["steady step <= torch.compile reduce-overhead (best packgraph variant)"]["met"] is True
    assert targets["first step >= 10x faster than compile reduce-overhead"]["met"] is True  # 15 s vs 1 s
    assert targets["<= 8 graphs over the varied batches (200 in a full run)"]["met"] is True
    assert targets["packgraph peak allocated <= 1.00x eager, every cell and method"]["met"] is False  # 1.05x
    # the detail gives the requested bytes beside the allocated ones (the allocator's block slack told apart)
    assert (
        "1050 MiB = 1.0500x (requested 0.9900x)"
        in targets["packgraph peak allocated <= 1.00x eager, every cell and method"]["detail"]
    )
    assert targets["packed+graphed tokens/s >= 2x padded eager on the corpus mix"]["met"] is True  # 30 / 5 = 6x
    assert targets["attention under default buckets <= 1.10x eager true-max time, every mix"]["met"] is None


def test_busy_target_detail_names_the_kernel_classes_that_differ():
    eager, pg = busy_split_cell()
    doc = results_doc([eager, pg])
    busy = next(t for t in bench_targets.check_targets(doc) if t["target"].startswith("GPU-busy under default buckets"))
    assert busy["met"] is False  # 4.4 / 4.0 = 1.1x
    assert busy["detail"] == (
        "small T=2048 corpus: busy 4.40 / 4.00 ms = 1.100x eager (attention fwd +0.300, elementwise +0.100, "
        "gemm +0.000 ms)"
    )


def _medium(record):
    return {**record, "model": "medium", "T": 8192}


def test_document_mask_targets_count_graph_sets_and_the_medium_ratio_to_compile_ro():
    from tests.bench.records import record

    docmask_stream = record("packgraph-docmask", 6.0, graphs=1, peak=900.0)
    eager = record("eager", 20.0, peak=1000.0)
    medium = [
        _medium(record("eager", 84.0, peak=10000.0)),
        _medium(record("packgraph", 83.0, graphs=4, peak=9990.0)),
        _medium(record("packgraph-docmask", 49.0, graphs=2, peak=8000.0)),  # 49 / 55 = 0.89x; 2 graph sets
        _medium(record("compile-ro", 55.0, graphs=2)),
    ]
    targets = {t["target"]: t for t in bench_targets.check_targets(results_doc([eager, docmask_stream, *medium]))}
    graphs = targets["document-mask backend: 1 graph set over every varied stream"]
    assert graphs["met"] is False and "medium T=8192 corpus packgraph-docmask: 2 over 200 batches" in graphs["detail"]
    ratio = targets["medium: best packgraph variant <= 0.90x compile reduce-overhead"]
    assert (
        ratio["met"] is True and ratio["detail"] == "medium T=8192 corpus: packgraph-docmask 49.00 / 55.00 ms = 0.89x"
    )
    peak = targets["packgraph peak allocated <= 1.00x eager, every cell and method"]
    assert peak["met"] is True and "small T=2048 corpus packgraph-docmask: 900 MiB = 0.9000x" in peak["detail"]
    medium[2]["step_ms"] = 50.0  # 50 / 55 = 0.91x
    targets = {t["target"]: t for t in bench_targets.check_targets(results_doc([eager, *medium]))}
    assert targets["medium: best packgraph variant <= 0.90x compile reduce-overhead"]["met"] is False
    assert targets["document-mask backend: 1 graph set over every varied stream"]["met"] is False
    docmask_stream["graphs"] = 1
    targets = {t["target"]: t for t in bench_targets.check_targets(results_doc([eager, docmask_stream]))}
    assert targets["document-mask backend: 1 graph set over every varied stream"]["met"] is True
    assert targets["medium: best packgraph variant <= 0.90x compile reduce-overhead"]["met"] is None
