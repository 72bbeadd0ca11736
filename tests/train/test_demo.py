"""`packgraph demo` on the CPU: its figures against the runs' own logs, the loss comparison, the shared timed steps."""

import json
import math
import statistics
from dataclasses import replace

import pytest
import torch

from packgraph.bench.profiling import KernelProfile
from packgraph.graphs import use_recorder
from packgraph.train import DataStream, TrainConfig, corpus_documents
from packgraph.train.demo import _new_signature_steps, _train_all, run_demo
from packgraph.train.demo_report import (
    DemoRun,
    _capture_steps,
    _difference_line,
    _timed_steps,
    compare_losses,
    method_figures,
    plot_demo,
    print_report,
    step_timing,
)
from tests.eager_recorder import EagerRecorder
from tests.train.tiny import numbers, tiny_cfg


def tiny(tmp_path, **kw) -> TrainConfig:
    """The shared tiny config, shortened for the demo's runs."""
    base = dict(steps=8, warmup_steps=1, max_docs=12, save_checkpoint=False, deterministic=True)
    return tiny_cfg(tmp_path, name="", **(base | kw))


def test_cpu_demo_writes_its_figures_and_plot(tmp_path):
    printed = []
    summary = run_demo(tiny(tmp_path), scopes=(), echo=printed.append)
    on_disk = json.loads((tmp_path / "demo.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    for key in ("device", "torch", "preset", "params", "T", "steps", "deterministic", "corpus", "packing", "buckets"):
        assert key in on_disk, key
    assert set(on_disk["methods"]) == {"eager"}
    assert all(math.isfinite(v) for _, v in numbers(on_disk)), [p for p, v in numbers(on_disk) if not math.isfinite(v)]
    png = tmp_path / "demo.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert printed[-1] == f"wrote {png} and {tmp_path / 'demo.json'}"
    assert "a GPU run adds" in printed[-2]

    # The figures, recomputed from the eager run's own log.
    rows = [json.loads(line) for line in (tmp_path / "eager" / "train.jsonl").read_text().splitlines()]
    eager = on_disk["methods"]["eager"]
    assert eager["losses"] == [r["loss"] for r in rows] and len(rows) == 8
    timed = [s - 1 for s in on_disk["timing"]["timed_steps"]]
    assert timed == list(range(1, 8))  # warm-up min(10, 8 // 5) = 1 step; no captures, nothing profiled on CPU
    assert eager["step_ms"] == pytest.approx(statistics.median(rows[s]["step_ms"] for s in timed))
    tokens, ms = sum(rows[s]["tokens"] for s in timed), sum(rows[s]["step_ms"] for s in timed)
    assert eager["tokens_per_s"] == pytest.approx(tokens / ms * 1e3)
    n = eager["loss_mean_steps"]
    assert eager["loss_first_mean"] == pytest.approx(sum(r["loss"] for r in rows[:n]) / n)
    assert eager["speedup"] == 1.0 and eager["gpu_busy_ms"] is None and eager["first_step_s"] > 0
    # The packing table: FFD puts every token in a bin, so its efficiency is real tokens over bin slots.
    ffd = on_disk["packing"]["ffd"]
    assert ffd["efficiency"] == pytest.approx(on_disk["corpus"]["total_tokens"] / (ffd["bins"] * 256))
    assert sum(u["batches"] for u in on_disk["buckets"]["used"]) == ffd["bins"]


def test_graphed_scopes_need_cuda(tmp_path):
    with pytest.raises(ValueError, match="need CUDA"):
        run_demo(tiny(tmp_path), scopes=("layer",), echo=lambda _s: None)


def test_graphed_runs_through_the_engine_on_the_cpu_stand_in(tmp_path):
    """The demo's graphed runs end to end, with the production engine recording through the CPU stand-in: same
    batches, bitwise equal losses, captures where a new bucket first comes, and no capture step timed."""
    cfg = tiny(tmp_path, steps=12, log_every=5, capacity_ladder=(2, 8, 32))  # 2 buckets met, the 2nd at step 3
    printed = []
    with use_recorder(EagerRecorder()):
        summary = run_demo(cfg, scopes=("layer", "model"), echo=printed.append)
    methods = summary["methods"]
    assert list(methods) == ["eager", "graphed-layer", "graphed-model"]
    for name in ("graphed-layer", "graphed-model"):
        assert methods[name]["losses"] == methods["eager"]["losses"], name
        assert methods[name]["vs_eager"]["bitwise_equal"] and methods[name]["graph_sets"] == 2
        assert f"{name.replace('-', ' ')} vs eager: bitwise equal losses over 12 steps" in printed
        rows = [json.loads(x) for x in (tmp_path / name / "train.jsonl").read_text().splitlines()]
        assert [r["buckets"] for r in rows] == [
            json.loads(x)["buckets"] for x in (tmp_path / "eager" / "train.jsonl").read_text().splitlines()
        ]
    timing = summary["timing"]
    assert timing["capture_steps"] == [1, 3]
    assert timing["timed_steps"] == list(range(4, 13))  # warm-up min(10, 12 // 5) = 2 steps, step 3 captured
    assert (tmp_path / "demo.png").is_file() and printed[-1].startswith("wrote ")


def test_compare_losses():
    assert compare_losses([3.0, 2.5, 2.0], [3.0, 2.5, 2.0]) == {
        "steps": 3,
        "bitwise_equal": True,
        "max_abs_diff": 0.0,
        "max_diff_step": None,
        "first_diff_step": None,
    }
    out = compare_losses([3.0, 2.5, 2.0, 1.5], [3.0, 2.5 + 1e-7, 2.2, 1.5])
    assert not out["bitwise_equal"] and out["first_diff_step"] == 2 and out["max_diff_step"] == 3
    assert out["max_abs_diff"] == pytest.approx(0.2)
    assert not compare_losses([3.0, 2.0], [3.0])["bitwise_equal"]  # a shorter curve is not an equal one
    # A diverged run (a NaN loss) is the largest difference wherever it comes, never a small one: Python's max()
    # would keep the 0.2 that precedes it.
    nan = float("nan")
    out = compare_losses([3.0, 2.5, 2.0, 1.5], [3.0, 2.7, nan, 1.5])
    assert math.isnan(out["max_abs_diff"]) and out["max_diff_step"] == 3 and out["first_diff_step"] == 2
    assert not out["bitwise_equal"]


def test_a_difference_is_printed_with_its_cause():
    cmp = compare_losses([3.0, 2.0, 1.0], [3.0, 2.1, 1.0])
    line = _difference_line("graphed layer", cmp, deterministic=True, control=None)
    assert "1.00e-01 at step 2" in line and "packgraph bug" in line
    control = compare_losses([3.0, 2.0, 1.0], [3.0, 2.05, 1.01])
    line = _difference_line("graphed layer", cmp, deterministic=False, control=control)
    assert "non-deterministic kernels" in line and "two eager runs of the same config end up 5.00e-02 apart" in line
    assert "bitwise equal losses over 3 steps" in _difference_line(
        "graphed model", compare_losses([1.0] * 3, [1.0] * 3), True, None
    )


def test_timed_steps_are_shared_and_leave_out_warmup_captures_and_profiled_steps():
    rows = [{"captures": c} for c in (1, 1, 1, 2, 2, 2, 3, 3, 3, 3)]
    runs = [
        DemoRun("graphed-layer", "graphed layer", None, rows=rows),
        DemoRun("eager", "eager", None, rows=[{"captures": 0}] * 10),
    ]
    captures = _capture_steps(runs)
    assert captures == {0, 3, 6}
    assert _timed_steps(10, 8, captures) == [2, 4, 5, 7]  # warm-up 2 steps; 8 and 9 are profiled
    assert _timed_steps(3, 3, {0, 1, 2}) == [0, 1, 2]  # nothing left: every step


def test_predicted_capture_steps_are_where_new_buckets_first_appear(tmp_path):
    cfg = tiny(tmp_path, steps=40, T=512, max_docs=30, capacity_ladder=(2, 8, 32))
    docs = corpus_documents(cfg)
    stream = DataStream(docs, T=cfg.T, policy=cfg.bucket_policy(), seed=cfg.seed)
    predicted = _new_signature_steps(stream, cfg)
    reference = DataStream(docs, T=cfg.T, policy=cfg.bucket_policy(), seed=cfg.seed)
    first_seen = {}
    for step in range(40):
        b = next(reference)
        first_seen.setdefault((b.max_seqlen, b.capacity), step)
    assert predicted == set(first_seen.values()) and len(predicted) >= 2


def test_several_runs_are_compared_timed_and_plotted(tmp_path):
    """The multi-run path on the CPU, with a stand-in for the CUDA profiler: every run trains to the profiled
    window before any run is profiled; the runs share their timed steps, which leave out the warm-up and the
    profiled steps; two eager runs of one config are bitwise equal; each gets a table row and a curve."""
    cfg = tiny(tmp_path, steps=6, deterministic=False)  # CPU kernels are deterministic anyway
    runs = [
        DemoRun(name, label, replace(cfg, out_dir=str(tmp_path / name)))
        for name, label in [("eager", "eager"), ("again", "eager again")]
    ]
    profiled = []

    def profile(trainer):  # what gpu_busy_ms does with the trainer's remaining steps, minus the profiler
        profiled.append((trainer.out_dir.name, trainer.step_index, [r.rows for r in runs]))
        start = trainer.step_index
        while not trainer.done:
            trainer.step()
        return KernelProfile(steps=6 - start, busy_ms=0.5, copy_ms=0.0, kernels=10.0, by_class={}, top=[])

    printed = []
    _train_all(runs, corpus_documents(cfg), window_start=4, echo=printed.append, profile=profile)
    assert [(name, at) for name, at, _ in profiled] == [("eager", 4), ("again", 4)]
    assert profiled[0][2] == [[], []]  # no run had finished when the first one was profiled
    timing = step_timing(runs, cfg, 4, torch.device("cpu"))
    assert timing["timed_steps"] == [2, 3, 4] and timing["profiled_steps"] == [5, 6]
    methods = method_figures(runs, timing)
    verdict = print_report(cfg, runs, methods, timing, printed.append)
    assert methods["again"]["vs_eager"]["bitwise_equal"] and verdict == "bitwise equal"
    assert "eager again vs eager: bitwise equal losses over 6 steps" in printed
    for name, m in methods.items():
        rows = [r for r in runs if r.name == name][0].rows
        assert m["gpu_busy_ms"] == 0.5 and m["kernels_per_step"] == 10.0
        assert m["step_over_busy"] == pytest.approx((rows[4]["step_ms"] + rows[5]["step_ms"]) / 2 / 0.5)
        assert m["step_ms"] == pytest.approx(statistics.median(rows[s]["step_ms"] for s in (1, 2, 3)))
    table = printed[next(i for i, p in enumerate(printed) if p.lstrip().startswith("step time")) + 1]
    assert "eager again" in table and "GPU-busy ms" in table
    assert methods["again"]["speedup"] == pytest.approx(methods["eager"]["step_ms"] / methods["again"]["step_ms"])
    png = plot_demo(runs, methods, verdict, tmp_path / "demo.png", echo=None)
    assert png is not None and png.stat().st_size > 10_000
