"""GPU: `packgraph demo` tells the truth on a first run.

* Default mode (deterministic kernels): the graphed runs' losses equal eager's bit for bit and the demo says so;
  every figure of demo.json is finite; the step times are over steps shared by every run, with no capture and no
  profiling in them; no UserWarning comes from packgraph or from the capture path.
* ``--fast``: a difference between eager and graphed is printed with its cause, the drift of a second eager run.

Each demo runs in a child process, as a user runs it: a fresh process also shows the warnings torch gives once
per process, and the demo's torch.profiler session stays out of the process that runs the other GPU tests.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.train.tiny import numbers

SRC = str(Path(__file__).resolve().parents[2] / "src")

# Runs the CLI and records every warning it raises, with where it came from.
_DRIVER = """
import json, os, sys, warnings
import packgraph
from packgraph.cli import main
record, argv = sys.argv[1], sys.argv[2:]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    code = main(argv)
found = [dict(category=w.category.__name__, message=str(w.message), filename=w.filename, lineno=w.lineno,
              user_warning=issubclass(w.category, UserWarning)) for w in caught]
package = os.path.dirname(os.path.abspath(packgraph.__file__)) + os.sep
json.dump({"code": code, "package": package, "warnings": found}, open(record, "w"))
sys.exit(code)
"""

SMALL = ["--preset", "tiny", "--T", "1024", "--max-docs", "40"]


def run_demo(tmp_path, *flags):
    out = tmp_path / "demo"
    record = tmp_path / "warnings.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    argv = ["demo", "--device", "cuda", "--out-dir", str(out), *SMALL, *flags]
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(record), *argv], capture_output=True, text=True, env=env, timeout=240
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print(done.stdout)
    summary = json.loads((out / "demo.json").read_text())
    return out, done.stdout, summary, json.loads(record.read_text())


def capture_path_warnings(record):
    """UserWarnings raised from packgraph's code (a warning from torch's C++ is raised at the Python line that
    called it) or about capture, CUDA graphs, streams or AccumulateGrad, wherever raised."""
    about_capture = re.compile(r"captur|cuda ?graph|AccumulateGrad|stream", re.IGNORECASE)
    return [
        w
        for w in record["warnings"]
        if w["user_warning"] and (w["filename"].startswith(record["package"]) or about_capture.search(w["message"]))
    ]


def other_warnings(record):
    flagged = capture_path_warnings(record)
    return sorted({f"{w['category']}: {w['message'][:120]}" for w in record["warnings"] if w not in flagged})


def test_demo_default_mode_is_bitwise_equal_and_warning_free(tmp_path, report):
    out, stdout, summary, record = run_demo(tmp_path, "--steps", "30")
    lines = stdout.strip().splitlines()
    assert lines[-1] == f"wrote {out / 'demo.png'} and {out / 'demo.json'}"
    assert (out / "demo.png").stat().st_size > 10_000
    assert summary["deterministic"] is True and summary["device"].startswith("cuda")
    methods = summary["methods"]
    assert list(methods) == ["eager", "graphed-layer", "graphed-model"]
    eager = methods["eager"]["losses"]
    assert len(eager) == 30
    for name in ("graphed-layer", "graphed-model"):
        assert methods[name]["losses"] == eager, name  # bit for bit, every step
        assert methods[name]["vs_eager"]["bitwise_equal"] is True
        assert methods[name]["graph_sets"] >= 1
        label = name.replace("-", " ")
        assert f"{label} vs eager: bitwise equal losses over 30 steps" in stdout
    bad = [p for p, v in numbers(summary) if not math.isfinite(v)]
    assert not bad, bad

    timing = summary["timing"]
    timed, captured, profiled = (set(timing[k]) for k in ("timed_steps", "capture_steps", "profiled_steps"))
    assert timing["timer"] == "cuda-events" and timed and profiled
    assert not timed & captured and not timed & profiled and 1 in captured
    assert max(captured) < min(profiled)  # every capture came before the first profiled step
    for name, m in methods.items():
        assert m["step_ms"] > 0 and m["first_step_s"] > 0 and m["gpu_busy_ms"] > 0, name
        assert m["step_over_busy"] > 0.5, (name, m["step_over_busy"])  # a step cannot be much shorter than its kernels
        report(f"demo tiny T=1024: {name} step ms (median of {len(timed)} shared steps)", round(m["step_ms"], 3))
        report(f"demo tiny T=1024: {name} step / GPU-busy", round(m["step_over_busy"], 3))
        report(f"demo tiny T=1024: {name} first step s", round(m["first_step_s"], 3))
    assert methods["eager"]["speedup"] == 1.0
    report("demo tiny T=1024: graphed layer speedup", round(methods["graphed-layer"]["speedup"], 2))
    report("demo tiny T=1024: graphed model speedup", round(methods["graphed-model"]["speedup"], 2))

    flagged = capture_path_warnings(record)
    assert not flagged, flagged
    report("demo: other warnings (not from packgraph or the capture path)", "; ".join(other_warnings(record)) or 0)


def test_demo_fast_mode_names_the_cause_of_a_difference(tmp_path, report):
    out, stdout, summary, record = run_demo(tmp_path, "--steps", "15", "--fast", "--scopes", "layer")
    assert summary["deterministic"] is False
    methods = summary["methods"]
    assert list(methods) == ["eager", "graphed-layer", "eager-rerun"]
    control = methods["eager-rerun"]["vs_eager"]
    assert methods["eager-rerun"]["speedup"] is None  # the control run is not in the speed table
    cmp = methods["graphed-layer"]["vs_eager"]
    if cmp["bitwise_equal"]:
        assert "graphed layer vs eager: bitwise equal losses over 15 steps" in stdout
    else:
        line = next(x for x in stdout.splitlines() if x.startswith("graphed layer vs eager:"))
        assert f"largest |loss diff| {cmp['max_abs_diff']:.2e} at step {cmp['max_diff_step']}" in line
        assert "non-deterministic kernels" in line and "two eager runs of the same config" in line
    report("demo --fast tiny 15 steps: max |loss diff| graphed layer vs eager", cmp["max_abs_diff"])
    report("demo --fast tiny 15 steps: max |loss diff| eager rerun vs eager", control["max_abs_diff"])
    flagged = capture_path_warnings(record)
    assert not flagged, flagged
