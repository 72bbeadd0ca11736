import json

import pytest

from tests.bench.records import load_bench_script, load_targets, record, results_doc

ladder_compare = load_bench_script("ladder_compare")


def test_the_graphed_methods_are_the_targets_own():
    assert ladder_compare.GRAPHED == load_targets().GRAPHED


def _run(ladder, eager_busy, pg_busy, eager_peak, pg_peak):
    doc = results_doc(
        [
            record("eager", 50.0, busy=eager_busy, peak=eager_peak, requested=eager_peak - 10, mix="short"),
            record("packgraph", 8.0, busy=pg_busy, graphs=5, peak=pg_peak, requested=pg_peak - 20, mix="short"),
            record("padded", 90.0, busy=9.0, peak=2000.0, mix="short"),  # not graphed: no row
        ]
    )
    doc["runs"] = [{"config": {"ladder": ladder}}]
    return doc


def test_rows_are_ratios_to_the_eager_record_of_the_same_run_and_cell():
    default, finer = _run("default", 8.0, 8.8, 1000.0, 1010.0), _run("capacity-x2", 10.0, 10.5, 1100.0, 1089.0)
    rows = ladder_compare.rows(default) + ladder_compare.rows(finer)
    assert [(r["ladder"], r["method"]) for r in rows] == [("default", "packgraph"), ("capacity-x2", "packgraph")]
    by = {r["ladder"]: r for r in rows}
    assert by["default"]["busy"] == pytest.approx(8.8 / 8.0)
    assert by["default"]["allocated"] == pytest.approx(1010.0 / 1000.0)
    assert by["default"]["requested"] == pytest.approx(990.0 / 990.0)
    assert by["capacity-x2"]["busy"] == pytest.approx(10.5 / 10.0)
    assert by["capacity-x2"]["allocated"] == pytest.approx(1089.0 / 1100.0)
    assert by["capacity-x2"]["graphs"] == 5

    table = ladder_compare.table(rows)
    assert "| small T=2048 short | packgraph | capacity-x2 | 5 | 8.00 | 1.050 | 0.9900 | 0.9807 |" in table


def test_a_cell_without_an_eager_record_gives_no_row_and_missing_figures_print_as_dashes():
    doc = results_doc([record("packgraph", 8.0, busy=8.0, graphs=2, peak=100.0, mix="long")])
    assert ladder_compare.rows(doc) == []

    doc = results_doc(
        [record("eager", 50.0, peak=1000.0, mix="long"), record("packgraph", 8.0, graphs=2, peak=990.0, mix="long")]
    )
    (row,) = ladder_compare.rows(doc)
    assert row["busy"] is None and row["requested"] is None and row["ladder"] == "default"
    assert "| - | 0.9900 | - |" in ladder_compare.table([row])


def test_main_reads_folders_and_files(tmp_path, capsys, monkeypatch):
    runs = {"a": _run("default", 8.0, 8.8, 1000.0, 1010.0), "b": _run("both-x2", 8.0, 8.4, 1000.0, 999.0)}
    for name, doc in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(doc))
    monkeypatch.setattr("sys.argv", ["ladder_compare.py", str(tmp_path / "a"), str(tmp_path / "b" / "results.json")])
    assert ladder_compare.main() == 0
    out = capsys.readouterr().out
    assert "| default |" in out and "| both-x2 |" in out
