"""The harness end to end on the CPU: the dry run's files, appending runs, flags, cells, the time limit."""

import json
import math

import pytest
import torch

from packgraph.bench import main
from tests.bench.records import RECORD_TYPES, load_targets

bench_targets = load_targets()


def _main_table_rows(md: str) -> list[list[str]]:
    """Data rows of the first Markdown table after '## Steps'."""
    lines = md.split("## Steps", 1)[1].strip().splitlines()
    table = []
    for line in lines:
        if not line.startswith("|"):
            break
        table.append([c.strip() for c in line.strip("|").split("|")])
    return table[2:]  # drop the header and the --- line


def test_dry_run_writes_well_formed_results(dry_run):
    out, argv, status = dry_run
    assert status == 0
    doc = json.loads((out / "results.json").read_text())
    assert {"machine", "runs", "streams", "records", "attention", "attention_summary"} <= set(doc)
    assert "targets" not in doc  # the goals are judged apart (packgraph.bench.targets)
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
    # packgraph.bench.targets, which gpu-check runs after the bench)
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


def test_a_run_under_another_ladder_records_it(tmp_path):
    argv = ["--dry-run", "--out", str(tmp_path), "--methods", "eager", "--steps", "2", "--no-attention"]
    assert main([*argv, "--ladder", "capacity-x2"]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["runs"][0]["config"]["ladder"] == "capacity-x2"
    assert [r["status"] for r in doc["records"]] == ["ok", "ok"]


def test_compare_prints_both_files_and_refuses_a_missing_one(tmp_path, capsys):
    from tests.bench.records import record, results_doc

    for name, step in (("a", 5.0), ("b", 6.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(results_doc([record("packgraph", step)])))
    assert main(["--compare", str(tmp_path / "a"), str(tmp_path / "b" / "results.json")]) == 0
    assert "| small T=2048 corpus | packgraph | 5.00 -> 6.00 | 1.200 | no range |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["--compare", str(tmp_path / "a"), str(tmp_path / "nowhere")])
    assert exc.value.code == 2
    assert "no results.json at" in capsys.readouterr().err
