"""Log tools: EMA, convergence report, throughput and reading train.jsonl."""

import math

import pytest

from packgraph.train.logs import convergence_report, ema, largest, read_log, throughput


def test_ema_and_convergence_report(tmp_path):
    values = [5.0, 4.0, 3.5, 3.0]
    # Independent: the debiased EMA is the weighted mean with weights beta^(t-i).
    for t in range(1, 5):
        w = [0.9 ** (t - i) for i in range(1, t + 1)]
        want = sum(wi * v for wi, v in zip(w, values[:t], strict=True)) / sum(w)
        assert ema(values, 0.9)[t - 1] == pytest.approx(want, rel=1e-12)
    ref = [{"step": s, "loss": 4.0 - 0.1 * s, "tokens": 100, "step_ms": 10.0} for s in range(1, 21)]
    off = [dict(r, loss=r["loss"] * 1.02, step_ms=5.0) for r in ref]
    report = convergence_report({"eager": ref, "graphed": off}, beta=0.9)
    assert report["max_rel_diff"]["graphed"] == pytest.approx(0.02, rel=1e-9)
    assert report["tokens_per_s"]["eager"] == pytest.approx(10_000)
    assert report["tokens_per_s"]["graphed"] == pytest.approx(20_000)
    assert report["final_loss"]["eager"] == pytest.approx(2.0) and report["common_steps"] == 20

    # Steady throughput leaves out warm-up steps and steps that captured graphs; overall keeps everything.
    rows = [{"tokens": 100, "step_ms": 10.0, "captures": 1} for _ in range(20)]
    rows[0] = dict(rows[0], step_ms=5000.0)  # first step: warm-up + first capture
    rows[12] = {"tokens": 100, "step_ms": 900.0, "captures": 2}  # a new bucket captured here
    rows[13:] = [dict(r, captures=2) for r in rows[13:]]
    steady, overall = throughput(rows)
    assert steady == pytest.approx(100 / 0.01)
    assert overall == pytest.approx(2000 / (5.0 + 0.9 + 18 * 0.01))

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "loss": 2.0}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_log(bad)
    with pytest.raises(FileNotFoundError):
        read_log(tmp_path / "missing.jsonl")


def test_largest_takes_the_first_nan_and_otherwise_the_first_maximum():
    nan = float("nan")
    assert largest([]) == (0.0, None)
    assert largest([0.1, 0.3, 0.3, 0.2]) == (0.3, 1)
    value, where = largest([0.1, 0.2, nan, 5.0, nan])
    assert math.isnan(value) and where == 2
    assert max([0.2, nan]) == 0.2  # why: the builtin keeps whatever precedes a NaN
