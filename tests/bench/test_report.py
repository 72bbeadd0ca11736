"""The tables: the README table, step/busy from the busy split, the kernel-class table."""

import json

import pytest

from packgraph.bench.report import (
    busy_delta,
    compare_table,
    kernel_class_table,
    readme_table,
    results_markdown,
    write_table,
)
from tests.bench.records import busy_split_cell, one_cell_records, record, results_doc


def test_readme_table_from_results():
    doc = results_doc(one_cell_records())
    table = readme_table(doc).splitlines()
    header = [c.strip() for c in table[2].strip("|").split("|")]
    row = [c.strip() for c in table[4].strip("|").split("|")]
    assert header[:4] == ["model", "T", "mix", "eager"]
    cells = dict(zip(header, row, strict=True))
    assert cells["eager"] == "20.00 ms"
    assert cells["packgraph"] == "5.00 ms (4.00x)"  # 20 / 5
    assert cells["padded"] == "30.00 ms (0.67x)"
    assert cells["packgraph step/busy"] == f"{5.0 / 4.5:.2f}"
    assert cells["packgraph memory / eager"] == "1.050 / -"  # peak allocated 1050 / 1000, no reserved figures
    assert len(table) == 5  # caption, blank, header, rule, one cell
    # the document-mask methods have columns of their own, after packgraph's FA2 ones and before the baselines
    doc = results_doc([*one_cell_records(), record("packgraph-docmask-model+compile", 4.0, busy=3.9)])
    header = [c.strip() for c in readme_table(doc).splitlines()[2].strip("|").split("|")]
    assert header[5:9] == ["packgraph-model", "packgraph-docmask-model+compile", "compile-ro", "padded"]
    assert "packgraph-docmask" not in header  # no record of it: no column


def test_busy_split_drives_step_over_busy_and_the_kernel_class_table():
    eager, pg = busy_split_cell()
    doc = results_doc([eager, pg])
    assert pg["step_over_busy"] == pytest.approx(4.84 / 4.4)
    assert eager["step_over_busy"] == pytest.approx(20.0 / 4.0)  # no profiled-batch mean: the median step
    assert busy_delta(pg, eager) == "attention fwd +0.300, elementwise +0.100, gemm +0.000 ms"
    assert busy_delta(pg, record("eager", 20.0, busy=4.0)) == ""  # no split, no explanation
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


def test_write_table_keeps_the_table_and_the_rows_with_a_date(tmp_path):
    rows = [{"T": 2048, "x": 1.5}]
    write_table(tmp_path / "new", "counts", "| T | x |", rows, {"host": "CPU"})
    assert (tmp_path / "new" / "counts.md").read_text() == "| T | x |\n"
    doc = json.loads((tmp_path / "new" / "counts.json").read_text())
    assert doc["rows"] == rows and doc["meta"]["host"] == "CPU" and doc["meta"]["date"].startswith("20")


def test_compare_table_calls_a_step_slower_or_faster_only_when_the_ranges_do_not_overlap(tmp_path):
    def rec(method, step, lo, hi, **kw):
        r = record(method, step, **kw)
        r.update(step_ms_p10=lo, step_ms_p90=hi)
        return r

    before = results_doc(
        [
            rec("eager", 20.0, 19.0, 21.0, busy=4.0, peak=1000.0),
            rec("packgraph", 5.0, 4.9, 5.1, busy=4.5, peak=1050.0, graphs=6),
            rec("packgraph-model", 5.0, 4.9, 5.1),
            rec("compile-ro", 5.5, 5.4, 5.6),
        ]
    )
    after = results_doc(
        [
            rec("eager", 21.0, 20.5, 22.0, busy=4.0, peak=1000.0),  # overlaps 19-21: noise
            rec("packgraph", 5.3, 5.2, 5.4, busy=4.6, peak=1040.0, graphs=6),  # 5.2 > 5.1: slower
            rec("packgraph-model", 4.5, 4.4, 4.8),  # 4.8 < 4.9: faster
            rec("padded", 30.0, 29.0, 31.0),  # only after
        ]
    )
    (tmp_path / "results.json").write_text(json.dumps(before))
    lines = compare_table(tmp_path, after).splitlines()  # a folder, a document
    rows = {cells[1]: cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    assert rows["eager"][2:5] == ["20.00 -> 21.00", "1.050", "within noise"]
    assert rows["packgraph"][2:8] == ["5.00 -> 5.30", "1.060", "slower", "4.50 -> 4.60", "1050 -> 1040", "6 -> 6"]
    assert rows["packgraph-model"][4] == "faster"
    assert rows["compile-ro"][2:5] == ["5.50 -> -", "-", "-"]
    assert rows["padded"][2:5] == ["- -> 30.00", "-", "-"]
    assert len(rows) == 5
    del after["records"][0]["step_ms_p90"]  # a record without its range: not judged
    assert "no range" in compare_table(before, after).splitlines()[2]
