"""scripts/gpu-check's --summary: the closing table of shards run in separate device calls (no GPU needed)."""

import json
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-check"


def _shard(root: Path, shard: str = "1/1", *, tests: int, failures: int = 0, skipped: int = 0, **meta) -> Path:
    out = root / shard.replace("/", "-")
    out.mkdir()
    base = dict(gpu="NVIDIA H200", torch="2.11.0+cu130", cuda="13.0", code="tree abc", shard=shard)
    (out / "meta.json").write_text(json.dumps({**base, **meta}))
    (out / "junit.xml").write_text(
        f'<testsuites><testsuite name="pytest" tests="{tests}" failures="{failures}" errors="0" '
        f'skipped="{skipped}"></testsuite></testsuites>'
    )
    row = {"test": "t", "name": f"figure of {shard}", "value": 1.5, "unit": "ms"}
    (out / "report.jsonl").write_text(json.dumps(row) + "\n")
    return out


def _summary(*dirs: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--summary", *map(str, dirs)], capture_output=True, text=True)


def test_shards_add_up_into_one_closing_table(tmp_path):
    one = _shard(tmp_path, "1/2", tests=10, skipped=2)
    two = _shard(tmp_path, "2/2", tests=7, failures=1)
    proc = _summary(one, two)
    assert proc.returncode == 0, proc.stderr
    assert "tests          : 14 passed, 1 failed, 2 skipped" in proc.stdout
    assert "tree abc (2 shards)" in proc.stdout
    assert "figure of 1/2" in proc.stdout and "figure of 2/2" in proc.stdout


@pytest.mark.parametrize(
    "second,why",
    [
        (dict(shard="2/3"), "not one complete set"),
        (dict(shard="1/2"), "not one complete set"),
        (dict(shard="2/2", code="tree def"), "differ in code"),
        (dict(shard="2/2", torch="2.13.0"), "differ in torch"),
    ],
)
def test_summary_refuses_shards_that_are_not_one_check(tmp_path, second, why):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = _shard(tmp_path / "a", "1/2", tests=3)
    two = _shard(tmp_path / "b", tests=3, **second)
    proc = _summary(one, two)
    assert proc.returncode != 0 and why in proc.stderr


def test_summary_refuses_a_shard_that_did_not_finish(tmp_path):
    one = _shard(tmp_path, "1/2", tests=3)
    two = tmp_path / "killed"
    two.mkdir()
    (two / "meta.json").write_text("{}")  # a run stopped before pytest wrote its junit.xml
    proc = _summary(one, two)
    assert proc.returncode != 0 and "holds no finished run" in proc.stderr
