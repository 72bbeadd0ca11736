"""The benchmark harness: the CPU dry run end to end, the padded baseline, the streams, and the report logic."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from packgraph.bench import main
from packgraph.bench.attention import evaluate_ladders, recommend_ladder
from packgraph.bench.data import batch_stream, doc_tokens, stream_stats
from packgraph.bench.methods import METHODS
from packgraph.bench.options import build_parser, resolve
from packgraph.bench.padded import padded_batch, padded_loss
from packgraph.bench.profiling import kernel_class, short_kernel_name
from packgraph.bench.report import busy_delta, derive, kernel_class_table, readme_table, results_markdown
from packgraph.buckets import default_buckets
from packgraph.models.gpt import GPT, GPTConfig
from packgraph.packing import PackedBatch


def _load_targets():
    """The repository's ``bench/targets.py``, by path (it is not part of the package, nor importable)."""
    path = Path(__file__).resolve().parents[1] / "bench" / "targets.py"
    spec = importlib.util.spec_from_file_location("bench_targets", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_targets = _load_targets()

# The schema a results.json record must follow (written out here, independently of the harness' own table).
NUM = (int, float)
OPT_NUM = (int, float, type(None))
RECORD_TYPES = {
    "model": str,
    "T": int,
    "mix": str,
    "method": str,
    "status": str,
    "error": (str, type(None)),
    "device": str,
    "timer": (str, type(None)),
    "steps": int,
    "step_ms": OPT_NUM,
    "step_ms_p10": OPT_NUM,
    "step_ms_p90": OPT_NUM,
    "real_tokens_per_step": OPT_NUM,
    "tokens_per_s": OPT_NUM,
    "speedup_vs_eager": OPT_NUM,
    "gpu_busy_ms": OPT_NUM,
    "gpu_copy_ms": OPT_NUM,
    "kernels_per_step": OPT_NUM,
    "busy_steps": (int, type(None)),
    "step_ms_busy_batches": OPT_NUM,
    "gpu_busy_by_class": (dict, type(None)),
    "top_kernels": (list, type(None)),
    "step_over_busy": OPT_NUM,
    "first_step_s": OPT_NUM,
    "first_loss": OPT_NUM,
    "first_loss_vs_eager": OPT_NUM,
    "graphs": (int, type(None)),
    "graph_batches": (int, type(None)),
    "predicted_graphs": (int, type(None)),
    "recompiles": (int, type(None)),
    "peak_mem_mib": OPT_NUM,
    "peak_mem_timed_mib": OPT_NUM,
    "peak_reserved_mib": OPT_NUM,
    "elapsed_s": OPT_NUM,
    "extra": dict,
    "run": int,
}


def _main_table_rows(md: str) -> list[list[str]]:
    """Data rows of the first Markdown table after '## Steps'."""
    lines = md.split("## Steps", 1)[1].strip().splitlines()
    table = []
    for line in lines:
        if not line.startswith("|"):
            break
        table.append([c.strip() for c in line.strip("|").split("|")])
    return table[2:]  # drop the header and the --- line


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["--dry-run", "--out", str(out), "--methods", "eager,padded,packgraph", "--steps", "2"]
    status = main(argv)
    return out, argv, status


def test_dry_run_writes_well_formed_results(dry_run):
    out, argv, status = dry_run
    assert status == 0
    doc = json.loads((out / "results.json").read_text())
    assert {"machine", "runs", "streams", "records", "attention", "attention_summary"} <= set(doc)
    assert "targets" not in doc  # the goals are the repository's (bench/targets.py), not the package's
    machine = doc["machine"]
    for key in ("device", "cpu", "date", "torch", "python"):
        assert isinstance(machine[key], str) and machine[key]
    assert machine["torch"] == torch.__version__
    assert doc["runs"][0]["argv"] == argv

    records = doc["records"]
    cells = {(r["model"], r["T"], r["mix"], r["method"]) for r in records}
    # one record per cell: 1 model x 1 T x 2 mixes (the dry-run preset) x 3 methods
    assert len(records) == len(cells) == 6
    assert {c[2] for c in cells} == {"corpus", "short"} and {c[3] for c in cells} == {"eager", "padded", "packgraph"}
    for r in records:
        assert set(r) == set(RECORD_TYPES), set(r) ^ set(RECORD_TYPES)
        for key, types in RECORD_TYPES.items():
            assert isinstance(r[key], types), (key, r[key])
        if r["method"] == "packgraph":  # CUDA only: recorded, not crashed
            assert r["status"] == "skipped" and "CUDA" in r["error"] and r["step_ms"] is None
        else:
            assert r["status"] == "ok" and r["error"] is None and r["timer"] == "perf-counter"
            assert r["steps"] == 2 and r["step_ms"] > 0 and r["first_step_s"] > 0
            assert r["step_ms_p10"] <= r["step_ms"] <= r["step_ms_p90"]
            assert r["tokens_per_s"] == pytest.approx(r["real_tokens_per_step"] / (r["step_ms"] / 1e3))
            assert math.isfinite(r["first_loss"])

    by_key = {(r["mix"], r["method"]): r for r in records}
    for mix in ("corpus", "short"):
        eager, padded = by_key[(mix, "eager")], by_key[(mix, "padded")]
        assert eager["speedup_vs_eager"] == pytest.approx(1.0)
        assert padded["speedup_vs_eager"] == pytest.approx(eager["step_ms"] / padded["step_ms"])
        # same weights, same first batch, same documents: the padded loss is the packed loss
        assert padded["first_loss"] == pytest.approx(eager["first_loss"], rel=1e-5)
        assert padded["first_loss_vs_eager"] < 1e-5 and eager["first_loss_vs_eager"] == 0.0
        assert padded["real_tokens_per_step"] == eager["real_tokens_per_step"]

    md = (out / "results.md").read_text()
    assert "Every method's first loss is within" in md
    rows = _main_table_rows(md)
    assert len(rows) == len(records)
    assert {(row[0], int(row[1]), row[2], row[3]) for row in rows} == cells

    attention = doc["attention"]
    assert attention, "the dry run includes the attention sweep"
    for row in attention:
        assert row["max_seqlen"] >= row["true_max"] and row["capacity"] >= row["num_seqs"]
        assert row["ms"] > 0
        if (row["max_seqlen"], row["capacity"]) == (row["true_max"], row["num_seqs"]):
            assert row["ratio"] == pytest.approx(1.0)
    assert any(s["ladder"] == "default" for s in doc["attention_summary"])
    verdicts = bench_targets.check_targets(out / "results.json")
    assert len(verdicts) >= 9 and all(t["met"] in (True, False, None) for t in verdicts)


def test_runs_append_and_replace(dry_run, tmp_path, monkeypatch):
    out, _, _ = dry_run
    report = tmp_path / "report.jsonl"
    monkeypatch.setenv("PACKGRAPH_REPORT", str(report))
    copy = tmp_path / "bench"
    copy.mkdir()
    (copy / "results.json").write_text((out / "results.json").read_text())
    before = json.loads((copy / "results.json").read_text())
    argv = ["--dry-run", "--out", str(copy), "--methods", "eager", "--mixes", "short", "--steps", "2", "--no-attention"]
    assert main(argv) == 0
    doc = json.loads((copy / "results.json").read_text())
    assert [run["argv"] for run in doc["runs"]] == [before["runs"][0]["argv"], argv]
    assert len(doc["records"]) == len(before["records"])  # replaced, not duplicated
    replaced = [r for r in doc["records"] if (r["mix"], r["method"]) == ("short", "eager")]
    assert len(replaced) == 1 and replaced[0]["run"] == 1
    assert sum(r["run"] == 0 for r in doc["records"]) == len(before["records"]) - 1
    assert len(doc["attention"]) == len(before["attention"])
    # gpu-check's closing table gets this run's record (from the bench) and every target verdict (from
    # bench/targets.py, which gpu-check runs after the bench)
    rows = [json.loads(line) for line in report.read_text().splitlines()]
    assert [r["name"] for r in rows if not r["name"].startswith("target")] == ["bench tiny T=128 short eager"]
    assert rows[0]["value"].startswith(f"{replaced[0]['step_ms']:.2f} ms")
    assert bench_targets.main([str(copy / "results.json"), "--report", str(report)]) == 0
    rows = [json.loads(line) for line in report.read_text().splitlines()]
    assert sum(r["name"].startswith("target: ") for r in rows) == len(bench_targets.check_targets(doc))


def test_bad_flags_exit_with_a_message(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--dry-run", "--methods", "eager,warp-drive"])
    assert exc.value.code == 2
    assert "warp-drive" in capsys.readouterr().err


def test_cells_select_exactly_the_methods_asked_per_cell(tmp_path):
    argv = ["--dry-run", "--out", str(tmp_path), "--steps", "2", "--no-attention"]
    argv += ["--cell", "tiny:128:short:eager,padded", "--cell", "tiny:96:corpus:eager"]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    got = sorted((r["T"], r["mix"], r["method"]) for r in doc["records"])
    assert got == [(96, "corpus", "eager"), (128, "short", "eager"), (128, "short", "padded")]
    assert all(r["status"] == "ok" for r in doc["records"])


def test_cell_methods_keep_names_with_a_plus(capsys):
    parser = build_parser()
    args = parser.parse_args(["--cell", "medium:8192:corpus:packgraph+compile,packgraph-model+compile"])
    assert args.cell == [["medium", 8192, "corpus", ["packgraph+compile", "packgraph-model+compile"]]]
    with pytest.raises(SystemExit):
        parser.parse_args(["--cell", "small:2048:corpus:eager+padded"])  # the old separator: no such method
    assert "unknown method(s) ['eager+padded']" in capsys.readouterr().err


def test_standard_preset_is_the_issue_cells_and_narrows_by_flags():
    parser = build_parser()
    cfg = resolve(parser.parse_args(["--standard"]))
    cells = {(m, T, mix): methods for m, T, mix, methods in cfg["cells"]}
    assert set(cells["small", 2048, "corpus"]) == set(METHODS)  # every method where the references are
    assert {"packgraph-model+compile", "compile-ro"} <= set(cells["medium", 8192, "corpus"])
    assert {"small", "medium"} == set(cfg["models"]) and {"corpus", "short", "long", "buckets"} == set(cfg["mixes"])
    assert {"eager", "packgraph"} <= set(cells["small", 2048, "buckets"])  # the tour of every bucket
    # the cells the targets need run first: a time limit cuts the tail
    assert [c[:3] for c in cfg["cells"][:2]] == [["small", 2048, "corpus"], ["medium", 8192, "corpus"]]
    narrowed = resolve(parser.parse_args(["--standard", "--models", "medium", "--methods", "eager,compile-ro"]))
    assert narrowed["cells"] == [["medium", 8192, "corpus", ["eager", "compile-ro"]]]
    with pytest.raises(SystemExit):
        parser.parse_args(["--cell", "tiny:x:short"])


@pytest.mark.parametrize("n_kv_head", [4, 2])
@pytest.mark.parametrize("padding_mask", [False, True])
def test_padded_loss_equals_packed_loss(n_kv_head, padding_mask):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_kv_head=n_kv_head)).double()
    lengths = [7, 1, 19, 3, 12]
    docs = [torch.randint(0, 256, (n,)) for n in lengths]
    batch = PackedBatch.from_documents(docs, bin_size=48, capacity=len(docs), max_seqlen=max(lengths))
    params = list(model.parameters())
    packed = model(batch)[1]  # reference: the packed model with its block-diagonal attention
    padded = padded_loss(model, padded_batch(batch), padding_mask=padding_mask)
    torch.testing.assert_close(padded, packed, rtol=1e-10, atol=1e-10)
    grads = zip(torch.autograd.grad(padded, params), torch.autograd.grad(packed, params), strict=True)
    for g_padded, g_packed in grads:
        torch.testing.assert_close(g_padded, g_packed, rtol=1e-8, atol=1e-10)


def test_padded_batch_layout():
    docs = [torch.arange(5), torch.arange(10, 13), torch.arange(20, 29)]
    batch = PackedBatch.from_documents(docs, bin_size=20, capacity=3, max_seqlen=9)
    pb = padded_batch(batch)
    assert pb.tokens.shape == (3, 9) and pb.lengths.tolist() == [5, 3, 9]
    for i, d in enumerate(docs):
        n = len(d)
        assert torch.equal(pb.tokens[i, :n], d)
        assert pb.labels[i, : n - 1].tolist() == d[1:].tolist()  # next token within the document
        assert (pb.labels[i, n - 1 :] == -100).all() and (pb.loss_mask[i, n - 1 :] == 0).all()
    assert pb.loss_mask.sum().item() == sum(len(d) - 1 for d in docs)


@pytest.mark.parametrize("mix", ["corpus", "short", "long"])
def test_batch_stream_has_exact_metadata(mix):
    T = 256
    stream = batch_stream(mix, T, 6, seed=3, max_corpus_docs=32)
    again = batch_stream(mix, T, 6, seed=3, max_corpus_docs=32)
    policy = default_buckets(T)
    for b, b2 in zip(stream, again, strict=True):
        assert torch.equal(b.tokens, b2.tokens)  # deterministic
        params = b.packed_seq_params
        assert b.total_tokens == T and sum(b.doc_lengths) <= T
        assert params.capacity == len(b.doc_lengths) and params.max_seqlen_q == max(b.doc_lengths)
        policy.bucket_for(max(b.doc_lengths), len(b.doc_lengths))  # every batch fits the default policy
        assert [len(d) for d in doc_tokens(b)] == list(b.doc_lengths)
    stats = stream_stats(mix, T, stream, policy)
    assert stats.batches == 6
    assert stats.docs_per_batch == pytest.approx(sum(len(b.doc_lengths) for b in stream) / 6)
    assert stats.distinct_buckets <= stats.distinct_exact_signatures
    if mix == "long":
        assert all(len(b.doc_lengths) <= 8 for b in stream)  # documents of at least T/8 tokens


def _record(method, step_ms, busy=None, first=None, graphs=None, peak=None, tokens=1000.0, mix="corpus"):
    row = dict.fromkeys(RECORD_TYPES)
    row.update(
        model="small",
        T=2048,
        mix=mix,
        method=method,
        status="ok",
        step_ms=step_ms,
        gpu_busy_ms=busy,
        first_step_s=first,
        graphs=graphs,
        graph_batches=200 if graphs is not None else None,
        peak_mem_mib=peak,
        real_tokens_per_step=tokens,
        extra={},
        run=0,
    )
    return row


def _doc(records):
    derive(records)
    return {"machine": {"gpu": "Test GPU"}, "runs": [], "records": records, "attention": []}


def test_targets_and_readme_table_from_results():
    records = [
        _record("eager", 20.0, busy=4.0, first=0.5, peak=1000.0),
        _record("packgraph", 5.0, busy=4.5, first=1.0, graphs=6, peak=1050.0),  # 1.11x busy: met
        _record("packgraph-model", 5.0, busy=4.5, first=2.0, graphs=6),  # 1.11x busy > 1.05: not met
        _record("compile-ro", 5.5, busy=4.0, first=15.0, graphs=40),
        _record("padded", 30.0, busy=20.0),
    ]
    doc = _doc(records)
    targets = {t["target"]: t for t in bench_targets.check_targets(doc)}
    assert targets["small, T<=4096: packgraph step <= 1.15x GPU-busy"]["met"] is True
    assert targets["small, T<=4096: packgraph-model step <= 1.05x GPU-busy"]["met"] is False
    assert "1.11x" in targets["small, T<=4096: packgraph-model step <= 1.05x GPU-busy"]["detail"]
    assert targets["GPU-busy under default buckets <= 1.02x eager's (true max_seqlen)"]["met"] is False  # 4.5 / 4.0
    assert targets["steady step <= torch.compile reduce-overhead (best packgraph variant)"]["met"] is True
    assert targets["first step >= 10x faster than compile reduce-overhead"]["met"] is True  # 15 s vs 1 s
    assert targets["<= 8 graphs over the varied batches (200 in a full run)"]["met"] is True
    assert targets["packgraph peak allocated <= 1.00x eager, every cell and method"]["met"] is False  # 1.05x
    assert "1.05x" in targets["packgraph peak allocated <= 1.00x eager, every cell and method"]["detail"]
    assert targets["packed+graphed tokens/s >= 2x padded eager on the corpus mix"]["met"] is True  # 30 / 5 = 6x
    assert targets["attention under default buckets <= 1.10x eager true-max time, every mix"]["met"] is None

    table = readme_table(doc).splitlines()
    header = [c.strip() for c in table[2].strip("|").split("|")]
    row = [c.strip() for c in table[4].strip("|").split("|")]
    assert header[:4] == ["model", "T", "mix", "eager"]
    cells = dict(zip(header, row, strict=True))
    assert cells["eager"] == "20.00 ms"
    assert cells["packgraph"] == "5.00 ms (4.00x)"  # 20 / 5
    assert cells["padded"] == "30.00 ms (0.67x)"
    assert cells["packgraph step/busy"] == f"{5.0 / 4.5:.2f}"
    assert cells["packgraph memory / eager"] == "1.05 / -"  # peak allocated 1050 / 1000, no reserved figures
    assert len(table) == 5  # caption, blank, header, rule, one cell


@pytest.mark.parametrize(
    "name, cls",
    [
        ("void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64>>", "attention bwd"),
        ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention fwd"),
        ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NNT", "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
        (
            "void at::native::multi_tensor_apply_kernel<TensorListMetadata<2>, BinaryOpListAlphaFunctor>",
            "foreach (grad buffers)",
        ),
        ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", "inductor (triton)"),
        ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float>", "reduction"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "elementwise"),
        ("Memset (Device)", "memcpy/memset"),
        ("Memcpy HtoD (Pageable -> Device)", "memcpy/memset"),
        ("some_custom_kernel", "other"),
    ],
)
def test_kernel_classes(name, cls):
    assert kernel_class(name) == cls


def test_short_kernel_names_keep_the_functor():
    ns = "at::native::(anonymous namespace)::"
    name = f"void {ns}multi_tensor_apply_kernel<{ns}ZeroFunctor>"
    assert short_kernel_name(name) == "multi_tensor_apply_kernel<ZeroFunctor>"
    assert len(short_kernel_name("x" * 500)) == 160


def test_busy_split_drives_step_over_busy_and_the_busy_target_detail():
    eager = _record("eager", 20.0, busy=4.0)
    pg = _record("packgraph", 5.0, busy=4.4)
    eager["gpu_busy_by_class"] = {"gemm": 3.0, "attention fwd": 0.5, "elementwise": 0.5, "memcpy/memset": 0.1}
    pg["gpu_busy_by_class"] = {"gemm": 3.0, "attention fwd": 0.8, "elementwise": 0.6, "memcpy/memset": 0.3}
    eager["busy_steps"] = pg["busy_steps"] = 8
    pg["kernels_per_step"] = 2170.0
    pg["step_ms_busy_batches"] = 4.84  # the profiled batches' mean step, not the pool's median
    doc = _doc([eager, pg])
    assert pg["step_over_busy"] == pytest.approx(4.84 / 4.4)
    assert eager["step_over_busy"] == pytest.approx(20.0 / 4.0)  # no profiled-batch mean: the median step
    assert busy_delta(pg, eager) == "attention fwd +0.300, elementwise +0.100, gemm +0.000 ms"
    assert busy_delta(pg, _record("eager", 20.0, busy=4.0)) == ""  # no split, no explanation
    busy = next(t for t in bench_targets.check_targets(doc) if t["target"].startswith("GPU-busy under default buckets"))
    assert busy["met"] is False  # 4.4 / 4.0 = 1.1x
    assert busy["detail"] == (
        "small T=2048 corpus: busy 4.40 / 4.00 ms = 1.100x eager (attention fwd +0.300, elementwise +0.100, "
        "gemm +0.000 ms)"
    )
    table = kernel_class_table(doc["records"]).splitlines()
    assert [c.strip() for c in table[0].strip("|").split("|")] == [
        "model",
        "T",
        "mix",
        "method",
        "steps",
        "kernels/step",
        "gemm",
        "attention fwd",
        "elementwise",
        "memcpy/memset",
    ]  # classes ordered by total time over the records
    assert [c.strip() for c in table[3].strip("|").split("|")][3:] == [
        "packgraph",
        "8",
        "2170",
        "3.000",
        "0.800",
        "0.600",
        "0.300",
    ]
    assert "## GPU-busy by kernel class" in results_markdown(doc)


def test_ladder_evaluation_and_recommendation():
    # one packing per mix at T=1024; ratios chosen so that a coarse ladder is slow on the short mix
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
    summary = {s["ladder"]: s for s in evaluate_ladders(rows)}
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


def test_time_limit_skips_the_units_not_started_and_still_writes_the_results(tmp_path):
    # A limit already passed when the matrix starts: every unit is recorded as skipped (none is lost from the
    # JSON, none is measured), and the table and the JSON are written as after a complete run.
    argv = ["--dry-run", "--out", str(tmp_path), "--methods", "eager,padded", "--no-attention", "--time-limit-s", "0"]
    status = main(argv)
    assert status == 1  # nothing was measured
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["runs"][0]["config"]["time_limit_s"] == 0 and doc["runs"][0]["finished"]
    records = doc["records"]
    expected = {(mix, method) for mix in ("corpus", "short") for method in ("eager", "padded")}
    assert {(r["mix"], r["method"]) for r in records} == expected
    for r in records:
        assert r["status"] == "skipped" and "time limit (0 s)" in r["error"] and r["step_ms"] is None
    assert "time limit" in (tmp_path / "results.md").read_text()


def test_bucket_tour_visits_every_reachable_bucket():
    from packgraph.bench.data import batch_stream
    from packgraph.buckets import default_buckets

    T = 1024
    policy = default_buckets(T)
    # every (longest document, document count) a batch of T rows can have, and the buckets they land in
    reachable = {policy.bucket_for(longest, n) for n in range(1, T + 1) for longest in range(1, T - n + 2)}
    stream = batch_stream("buckets", T, 2 * len(reachable), max_corpus_docs=8)
    assert all(b.tokens.shape == (T,) for b in stream)
    assert {policy.bucket_of(b.packed_seq_params) for b in stream} == reachable
