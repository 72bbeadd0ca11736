"""``scripts/memory-compare`` on two hand-made traces (the format ``scripts/memory-probe --dump`` writes), whose
peaks and live blocks are worked out by hand here."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "memory-compare"
MiB = 2**20


def _write(path, method, base, events, sites):
    doc = dict(method=method, base=base, peaks=[], sites=sites, events=events)
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return path


def _traces(tmp_path):
    sites = ["act | a", "head | h", "fa | f"]
    # eager: step 0 peaks at 10 + 4 + 3 = 17 MiB (act, head); step 1 at 10 + 4 + 2 = 16 MiB
    eager = [
        [0, "alloc", 1, 4 * MiB, 0, 0],
        [0, "alloc", 2, 3 * MiB, 0, 1],
        [0, "free_requested", 2, 3 * MiB, 0, 1],
        [0, "free_requested", 1, 4 * MiB, 0, 0],
        [1, "alloc", 3, 4 * MiB, 0, 0],
        [1, "alloc", 4, 2 * MiB, 0, 2],
        [1, "free_requested", 4, 2 * MiB, 0, 2],
        [1, "free_requested", 3, 4 * MiB, 0, 0],
    ]
    # graphed: step 1 is a capture that holds act and 5 MiB of fa at once: 10 + 4 + 5 = 19 MiB, its peak
    graphed = [
        [0, "alloc", 1, 4 * MiB, 0, 0],
        [0, "free_requested", 1, 4 * MiB, 0, 0],
        [1, "alloc", 5, 4 * MiB, 0, 0],
        [1, "alloc", 6, 5 * MiB, 0, 2],
        [1, "free_requested", 6, 5 * MiB, 0, 2],
        [1, "free_requested", 5, 4 * MiB, 0, 0],
    ]
    a = _write(tmp_path / "eager.json.gz", "eager", 10 * MiB, eager, sites)
    b = _write(tmp_path / "graphed.json.gz", "packgraph", 10 * MiB, graphed, sites)
    return a, b


def _run(*args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, check=True, timeout=60
    ).stdout


def test_peaks_per_step_and_the_live_difference_at_the_graphed_peak(tmp_path):
    a, b = _traces(tmp_path)
    out = _run(a, b)
    assert "(eager): peak 17.0 MiB at step 0, by head | h" in out
    assert "per step: 0:17 1:16" in out
    assert "(packgraph): peak 19.0 MiB at step 1, by fa | f" in out
    assert "per step: 0:14 1:19" in out
    # compared within the graphed peak's step (1): eager's peak there is act + fa = 16, graphed's act + fa = 19
    assert "live at each one's peak of step 1: 16.0 / 19.0 MiB; B - A by site:" in out
    assert "+3.0  (     2.0 ->      5.0)  fa | f" in out
    assert "act | a" not in out.split("B - A by site:")[1]  # no difference there, so not listed


def test_step_flag_compares_another_step(tmp_path):
    a, b = _traces(tmp_path)
    out = _run(a, b, "--step", 0)
    assert "live at each one's peak of step 0: 17.0 / 14.0 MiB; B - A by site:" in out
    tail = out.split("B - A by site:")[1]
    assert "-3.0  (     3.0 ->      0.0)  head | h" in tail
