"""scripts/gpu-check's --summary: the closing table of shards run in separate device calls (no GPU needed)."""

import json
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-check"


def _split(count: int, jobs: int, j: int) -> int:
    return count // jobs + (j < count % jobs)


def _shard(
    root: Path,
    shard: str = "1/1",
    *,
    tests: int,
    failures: int = 0,
    skipped: int = 0,
    jobs: int = 1,
    exits=None,
    bench_exit: str | None = None,
    **m,
) -> Path:
    """A shard's folder as gpu-check leaves it; with jobs > 1, the counts are split over the pytest processes."""
    out = root / shard.replace("/", "-")
    out.mkdir()
    base = dict(
        gpu="NVIDIA H200",
        torch="2.11.0+cu130",
        cuda="13.0",
        code="tree abc",
        shard=shard,
        jobs=jobs,
        packages={"megatron-core": "0.19.2"},
    )
    (out / "meta.json").write_text(json.dumps({**base, **m}))
    names = ["junit.xml"] if jobs == 1 else [f"junit-{j}.xml" for j in range(1, jobs + 1)]
    exits = exits or [1 if failures else 0] * jobs
    for j, (name, code) in enumerate(zip(names, exits, strict=True)):
        (out / name).write_text(
            f'<testsuites><testsuite name="pytest" tests="{_split(tests, jobs, j)}" '
            f'failures="{_split(failures, jobs, j)}" errors="0" skipped="{_split(skipped, jobs, j)}"></testsuite>'
            "</testsuites>"
        )
        (out / f"{name}.exit").write_text(f"{code}\n")
    if bench_exit is not None:
        (out / "bench.exit").write_text(f"{bench_exit}\n")
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
    assert "packages       : megatron-core 0.19.2" in proc.stdout
    assert "figure of 1/2" in proc.stdout and "figure of 2/2" in proc.stdout
    assert proc.stdout.rstrip().endswith("verdict        : FAIL (1 failed)")


def test_the_verdict_is_pass_only_with_no_failure_and_every_package(tmp_path):
    proc = _summary(_shard(tmp_path, tests=5, skipped=1))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().endswith("verdict        : pass")


@pytest.mark.parametrize(
    "shards,verdict",
    [
        ([dict(bench=False), dict(bench=True, bench_exit="0")], "pass"),
        ([dict(bench=False), dict(bench=True)], "INCOMPLETE (the benchmark of shard 2/2 (exit none: stopped before"),
        ([dict(bench=False), dict(bench=True, bench_exit="1")], "INCOMPLETE (the benchmark of shard 2/2 (exit 1)"),
        ([dict(bench=False), dict(bench=False)], "INCOMPLETE (tests only"),
    ],
)
def test_the_verdict_is_pass_only_once_a_shard_ran_the_benchmark_to_its_end(tmp_path, shards, verdict):
    """A shard cut during its benchmark (a device call's limit) has every junit file: only bench.exit tells."""
    dirs = [_shard(tmp_path, f"{k}/2", tests=3, **m) for k, m in enumerate(shards, 1)]
    proc = _summary(*dirs)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip().splitlines()[-1].startswith(f"verdict        : {verdict}")


@pytest.mark.parametrize(
    "second,why",
    [
        (dict(shard="2/3"), "not one complete set"),
        (dict(shard="1/2"), "not one complete set"),
        (dict(shard="2/2", code="tree def"), "differ in code"),
        (dict(shard="2/2", torch="2.13.0"), "differ in torch"),
        (dict(shard="2/2", packages={"megatron-core": None}), "differ in packages"),
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


def test_a_shard_run_in_several_pytest_processes_counts_all_of_them(tmp_path):
    one = _shard(tmp_path, "1/2", tests=11, skipped=3, jobs=3)
    two = _shard(tmp_path, "2/2", tests=7, failures=2, jobs=2)
    proc = _summary(one, two)
    assert proc.returncode == 0, proc.stderr
    assert "tests          : 13 passed, 2 failed, 3 skipped" in proc.stdout


def test_summary_refuses_a_shard_whose_pytest_was_interrupted(tmp_path):
    one = _shard(tmp_path, "1/1", tests=6, jobs=3, exits=[0, 2, 0])  # GPU_CHECK_TIMEOUT stopped process 2
    proc = _summary(one)
    assert proc.returncode != 0 and "stopped early" in proc.stderr


def test_a_pytest_process_whose_files_held_no_test_to_run_counts_as_finished(tmp_path):
    """Exit 5: its only file was skipped whole (Liger's, without liger-kernel); the verdict names the package."""
    one = _shard(tmp_path, "1/1", tests=4, skipped=1, jobs=2, exits=[0, 5], packages={"liger-kernel": None})
    proc = _summary(one)
    assert proc.returncode == 0, proc.stderr
    assert "verdict        : INCOMPLETE (liger-kernel missing" in proc.stdout


def test_summary_refuses_a_shard_missing_one_of_its_pytest_processes(tmp_path):
    one = _shard(tmp_path, "1/1", tests=6, jobs=3)
    (one / "junit-3.xml").unlink()  # killed before pytest could write it
    proc = _summary(one)
    assert proc.returncode != 0 and "holds no finished run" in proc.stderr


def test_the_table_names_an_optional_package_missing_on_the_device(tmp_path):
    """Without megatron-core its test files skip whole: the closing table says so beside the counts."""
    proc = _summary(_shard(tmp_path, tests=5, skipped=2, packages={"megatron-core": None, "trl": "1.16.0"}))
    assert proc.returncode == 0, proc.stderr
    assert "packages       : megatron-core MISSING, trl 1.16.0" in proc.stdout
    assert "verdict        : INCOMPLETE (megatron-core missing, so their test files did not run" in proc.stdout


def _wheel(folder: Path, name: str, version: str) -> None:
    """A minimal pure-Python wheel: one module and its dist-info."""
    import zipfile

    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{name}.py", "VALUE = 1\n")
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")


@pytest.mark.parametrize("versions,expect", [(["1.0"], "installed 1 wheels from .whl/"), (["1.0", "2.0"], "failed")])
def test_a_run_installs_the_wheels_of_dot_whl_before_the_tests(tmp_path, versions, expect):
    """A device run that forgot its carried wheels skipped three test files: gpu-check installs .whl/ itself, and
    stops when pip refuses the set (two versions of one package)."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "gpu-check").write_text(SCRIPT.read_text())
    (tmp_path / "tests" / "cuda").mkdir(parents=True)
    (tmp_path / "tests" / "cuda" / "test_probe_cuda.py").write_text("")
    (tmp_path / ".whl").mkdir()
    for version in versions:
        _wheel(tmp_path / ".whl", "pgwheelprobe", version)
    proc = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "gpu-check"), "--tests"], capture_output=True, text=True, cwd=tmp_path
    )
    assert expect in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode != 0  # no CUDA here (or the failed install)


def _plan(root: Path, shard: str, jobs: int) -> list[list[str]]:
    proc = subprocess.run(
        ["bash", str(root / "scripts" / "gpu-check"), "--plan", "--shard", shard, "--jobs", str(jobs)],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line.split() for line in proc.stdout.splitlines()]


def test_the_plan_deals_every_file_once_longest_first_to_the_least_loaded(tmp_path):
    """Each shard computes the same deal of the GPU test files over shards x jobs processes: every file once, the
    longest (by tests/cuda/durations.json) first, each to the least loaded process; unlisted files count as the
    median."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "gpu-check").write_text(SCRIPT.read_text())
    (tmp_path / "tests" / "cuda").mkdir(parents=True)
    seconds = {"a": 100.0, "b": 90.0, "c": 10.0, "d": 10.0, "e": 10.0, "f": 5.0, "g": 5.0}
    for name in [*seconds, "new"]:
        (tmp_path / "tests" / "cuda" / f"test_{name}_cuda.py").write_text("")
    durations = {f"tests/cuda/test_{name}_cuda.py": s for name, s in seconds.items()}
    (tmp_path / "tests" / "cuda" / "durations.json").write_text(json.dumps(durations))
    plans = [_plan(tmp_path, f"{k}/2", 2) for k in (1, 2)]
    processes = [files for plan in plans for files in plan]
    dealt = sorted(f for files in processes for f in files)
    assert dealt == sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "tests" / "cuda").glob("test_*.py"))
    load = {f: durations.get(f, 10.0) for f in dealt}  # the median of the listed seconds is 10
    totals = sorted(sum(load[f] for f in files) for files in processes)
    # LPT over 4 processes: a=100 and b=90 alone; the rest (10 x 4 with "new", 5 x 2) split 25 / 25
    assert totals == [25.0, 25.0, 90.0, 100.0], processes
    assert ["tests/cuda/test_a_cuda.py"] in processes and ["tests/cuda/test_b_cuda.py"] in processes


def test_durations_sum_each_files_tests_and_a_later_folder_wins(tmp_path):
    for name, cases in (("old", [("test_x_cuda", 5.0), ("test_y_cuda", 7.0)]), ("new", [("test_x_cuda", 1.5)] * 2)):
        out = tmp_path / name
        out.mkdir()
        body = "".join(f'<testcase classname="tests.cuda.{m}" name="t" time="{s}"/>' for m, s in cases)
        (out / "junit-1.xml").write_text(f"<testsuites><testsuite>{body}</testsuite></testsuites>")
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--durations", str(tmp_path / "old"), str(tmp_path / "new")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"tests/cuda/test_x_cuda.py": 3.0, "tests/cuda/test_y_cuda.py": 7.0}
