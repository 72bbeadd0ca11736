"""``scripts/bench-detached``: a bench run in a session of its own, started by one command and collected by another."""

import json
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench-detached"


def _run(*args, check=True):
    return subprocess.run([str(SCRIPT), *map(str, args)], capture_output=True, text=True, check=check, timeout=300)


def test_start_returns_at_once_and_wait_collects_the_finished_run(tmp_path):
    run, dest = tmp_path / "run", tmp_path / "dest"
    _run("start", run, "--", "--dry-run")
    assert _run("wait", run, dest, 0, check=False).returncode == 3  # the run takes seconds: still running
    assert (dest / "started").exists()  # what the run has written so far, copied
    assert _run("wait", run, dest, 240).returncode == 0
    log = (dest / "bench.log").read_text()
    assert log.rstrip().endswith("rc=0"), log
    records = json.loads((dest / "b" / "results.json").read_text())["records"]
    assert records and all(r["status"] == "ok" for r in records)


def test_a_second_start_in_the_same_directory_is_refused(tmp_path):
    run = tmp_path / "run"
    _run("start", run, "--", "--dry-run")
    second = _run("start", run, "--", "--dry-run", check=False)
    assert second.returncode == 2 and "already started" in second.stderr
    assert _run("wait", run, tmp_path / "dest", 240).returncode == 0
    assert _run("wait", tmp_path / "none", tmp_path / "dest", 1, check=False).returncode == 2
