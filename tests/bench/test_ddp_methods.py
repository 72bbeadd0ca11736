"""The bench's data-parallel methods on the CPU: ``eager-ddp`` runs the eager step inside torch DDP on a process
group of one (gloo), in a process of its own (the group is process-wide), with the same first loss as ``eager``."""

import json
import subprocess
import sys


def test_eager_ddp_runs_the_eager_step_inside_ddp(tmp_path):
    cmd = [sys.executable, "-m", "packgraph", "bench", "--dry-run", "--cell", "tiny:128:corpus:eager,eager-ddp",
           "--no-attention", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = {r["method"]: r for r in json.loads((tmp_path / "results.json").read_text())["records"]}
    assert records["eager"]["status"] == records["eager-ddp"]["status"] == "ok"
    assert records["eager-ddp"]["first_loss"] == records["eager"]["first_loss"]
