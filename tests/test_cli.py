"""The ``packgraph`` command line: the demo end to end, train/score/plot-convergence, out dirs that hold an earlier
run (refused, overwritten, resumed in place), and every error path."""

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from packgraph.cli import main
from packgraph.data.stream import DataStream, corpus_documents
from packgraph.distributed.launch import torchrun_command
from packgraph.models.gpt import GPT, GPTConfig
from packgraph.score import score
from packgraph.train import TrainConfig, Trainer, load_checkpoint
from packgraph.train.logs import read_log


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_demo_runs_end_to_end_within_budget(tmp_path):
    exe = shutil.which("packgraph")
    cmd = [exe] if exe else [sys.executable, "-m", "packgraph"]
    out_dir = tmp_path / "demo"
    t0 = time.perf_counter()
    # The README's command as written (plus an out dir); CPU-only so the time budget is the CPU one.
    proc = subprocess.run(
        [*cmd, "demo", "--out-dir", str(out_dir), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert wall < 120, f"demo took {wall:.1f} s"  # the CPU CI budget (2 cores)
    assert "Warning" not in proc.stderr, proc.stderr[-2000:]
    assert str(out_dir) in proc.stdout
    assert "efficiency" in proc.stdout and "max_seqlen" in proc.stdout and "loss" in proc.stdout
    summary = json.loads((out_dir / "demo.json").read_text())
    rows = [json.loads(line) for line in (out_dir / "eager" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == summary["steps"]
    losses = [r["loss"] for r in rows]
    eager = summary["methods"]["eager"]
    assert eager["losses"] == losses and eager["loss_mean_steps"] == 5
    start, end = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert eager["loss_first_mean"] == pytest.approx(start)
    assert end < start - 0.5  # the demo's promise: the loss clearly drops
    assert f"{start:.3f} -> {end:.3f}" in proc.stdout
    *_, gpu_note, last = proc.stdout.strip().splitlines()
    assert "a GPU run adds" in gpu_note
    assert last == f"wrote {out_dir / 'demo.png'} and {out_dir / 'demo.json'}"
    assert (out_dir / "demo.png").stat().st_size > 10_000


def test_train_then_score_then_plot(tmp_path, capsys):
    run = tmp_path / "run"
    common = ["--device", "cpu", "--T", "128", "--max-docs", "3", "--seed", "2"]
    code, out, err = run_cli(
        capsys, "train", "--steps", "4", "--no-progress", "--deterministic", "--out-dir", str(run), *common
    )
    assert code == 0, err
    assert json.loads((run / "config.json").read_text())["deterministic"] is True
    assert "final loss" in out and "tokens/s" in out and str(run) in out
    rows = [json.loads(line) for line in (run / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert f"final loss {rows[-1]['loss']:.4f}" in out
    assert (run / "checkpoint.pt").is_file() and (run / "config.json").is_file()

    code, out, err = run_cli(
        capsys, "score", "--checkpoint", str(run), "--batches", "2", "--out-dir", str(tmp_path / "s"), *common
    )
    assert code == 0, err
    report = json.loads((tmp_path / "s" / "score.json").read_text())
    assert report["max_abs_diff"] is None and report["batches"] == 2  # no graphs on CPU
    # Independent check of the reported mean logprob: CE of the checkpoint's model on the same batches.
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    model = GPT(GPTConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    cfg = TrainConfig(T=128, max_docs=3, seed=2)
    data = DataStream(corpus_documents(cfg), T=128, policy=cfg.bucket_policy(), seed=2)
    ce, n = 0.0, 0
    with torch.no_grad():
        for _ in range(2):
            b = next(data)
            ce += float(F.cross_entropy(model(b.tokens, b.packed_seq_params), b.labels, reduction="sum"))
            n += int((b.labels != -100).sum())
    assert report["target_tokens"] == n
    assert report["mean_logprob"] == pytest.approx(-ce / n, rel=1e-5)

    other = tmp_path / "run2"
    code, _, err = run_cli(capsys, "train", "--steps", "4", "--no-progress", "--out-dir", str(other), *common)
    assert code == 0, err
    png = tmp_path / "conv" / "c.png"
    code, out, err = run_cli(
        capsys, "plot-convergence", "--logs", str(run / "train.jsonl"), str(other / "train.jsonl"), "--out", str(png)
    )
    assert code == 0, err
    summary = json.loads(png.with_suffix(".json").read_text())
    assert summary["max_rel_diff"] == {"run2": 0.0}  # same seed, same data, CPU: identical curves
    assert "max rel diff" in out


def test_score_function_eager_matches_token_logprobs():
    cfg = TrainConfig(T=128, max_docs=2)
    data = DataStream(corpus_documents(cfg), T=128, policy=cfg.bucket_policy())
    batches = [next(data), next(data)]
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    result = score(model, batches, graphed=False)
    assert result.max_abs_diff is None and result.graphed_ms is None
    for b, lp in zip(batches, result.logprobs, strict=True):
        logits = model(b.tokens, b.packed_seq_params).detach()
        want = -F.cross_entropy(logits, b.labels, reduction="none")  # 0 on ignored rows
        torch.testing.assert_close(lp, want, rtol=1e-6, atol=1e-6)
    assert math.isfinite(result.mean_logprob) and result.mean_logprob < 0
    with pytest.raises(RuntimeError, match="CUDA"):
        score(model, batches, graphed=True)


def test_score_reports_a_nan_batch_as_the_largest_difference(monkeypatch):
    """A graphed pass whose second batch comes out NaN must not read as a small difference (Python's max() keeps
    whatever precedes a NaN). The graphs run on the CPU stand-in; the NaN is injected into their second output."""
    from packgraph.graphs import use_recorder
    from packgraph.models.gpt import GraphedGPT
    from tests.eager_recorder import EagerRecorder

    cfg = TrainConfig(T=128, max_docs=2)
    data = DataStream(corpus_documents(cfg), T=128, policy=cfg.bucket_policy())
    batches = [next(data), next(data)]
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    calls = []
    real = GraphedGPT.token_logprobs

    def second_is_nan(self, batch, *args, **kwargs):
        out = real(self, batch, *args, **kwargs)
        calls.append(batch)
        return torch.full_like(out, float("nan")) if len(calls) % 2 == 0 else out

    monkeypatch.setattr(GraphedGPT, "token_logprobs", second_is_nan)
    with use_recorder(EagerRecorder()):
        result = score(model, batches, graphed=True)
    assert len(calls) == 4  # a capture pass, then the timed pass
    assert math.isnan(result.max_abs_diff)


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "required: COMMAND"),
        (["frobnicate"], "invalid choice"),
        (["train", "--preset", "huge"], "invalid choice: 'huge'"),
        (["train", "--steps", "0"], "positive integer"),
        (["train", "--steps", "many"], "positive integer"),
        (["train", "--T", "-4"], "positive integer"),
        (["train", "--scope", "everything"], "invalid choice"),
        (["train", "--log-every", "0"], "positive integer"),
        (["demo", "--scopes", "layer,everything"], "expected distinct scopes"),
        (["demo", "--device", "cpu", "--graphs"], "--graphs needs a CUDA device"),
        (["train", "--max-seqlen-ladder", "512,256"], "strictly increasing"),
        (["train", "--capacity-ladder", "8,x"], "comma-separated integers"),
        (["train", "--device", "cpu", "--T", "256", "--max-seqlen-ladder", "128,512"], "above T=256"),
        (["train", "--device", "bogus"], "unknown device 'bogus'"),
        (["train", "--device", "cpu", "--graphs"], "--graphs needs a CUDA device"),
        (["train", "--device", "cpu", "--resume", "/nonexistent/ckpt.pt"], "no checkpoint at /nonexistent/ckpt.pt"),
        (["score", "--device", "cpu", "--checkpoint", "/nonexistent"], "no checkpoint"),
        (["plot-convergence", "--logs", "/nonexistent.jsonl", "--out", "x.png"], "no log file"),
        (["plot-convergence", "--logs", "a.jsonl", "b.jsonl", "--labels", "a", "--out", "x.png"], "2 logs"),
        (["plot-convergence", "--logs", "a.jsonl"], "--out"),
    ],
)
def test_bad_flags_exit_2_with_a_message(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in err, err
    assert "Traceback" not in err + out


def test_bad_paths_exit_2(tmp_path, capsys):
    a_file = tmp_path / "file.txt"
    a_file.write_text("not a dir")
    code, _, err = run_cli(capsys, "train", "--device", "cpu", "--out-dir", str(a_file))
    assert code == 2 and "not a directory" in err
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x00garbage")
    code, _, err = run_cli(capsys, "score", "--device", "cpu", "--checkpoint", str(junk), "--out-dir", str(tmp_path))
    assert code == 2 and "not a packgraph checkpoint" in err and "Traceback" not in err
    log = tmp_path / "bad.jsonl"
    log.write_text("{broken\n")
    code, _, err = run_cli(capsys, "plot-convergence", "--logs", str(log), "--out", str(tmp_path / "p.png"))
    assert code == 2 and "bad.jsonl:1: not JSON" in err
    good = tmp_path / "good.jsonl"
    good.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    code, _, err = run_cli(capsys, "plot-convergence", "--logs", str(good), "--out", str(a_file / "p.png"))
    assert code == 2 and "is a file, not a directory" in err and "Traceback" not in err
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(2)}, foreign)
    out_dir = tmp_path / "never-made"
    code, _, err = run_cli(capsys, "train", "--device", "cpu", "--resume", str(foreign), "--out-dir", str(out_dir))
    assert code == 2 and "not a packgraph training checkpoint" in err and "Traceback" not in err
    assert not out_dir.exists()  # a run that never started leaves no empty out dir behind


def test_score_refuses_a_checkpoint_whose_unpickling_runs_code(tmp_path, capsys):
    marker = tmp_path / "code-ran"

    class RunsCode:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w').write('ran')",)

    evil = tmp_path / "evil.pt"
    keys = ("model_config", "model", "optimizer", "scheduler", "data", "step", "rng")
    torch.save({k: RunsCode() if k == "model" else {} for k in keys}, evil)
    code, out, err = run_cli(capsys, "score", "--device", "cpu", "--checkpoint", str(evil), "--out-dir", str(tmp_path))
    assert code == 2 and "refusing to load" in err and "could run any code" in err and "Traceback" not in err
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------- out dirs and resume
TINY = ["--device", "cpu", "--T", "128", "--max-docs", "3", "--no-progress", "--no-plot"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A 2-step train run with a checkpoint per step. Tests change copies of it (copy_run), never it."""
    run = tmp_path_factory.mktemp("tiny") / "run"
    assert main(["train", *TINY, "--steps", "2", "--checkpoint-every", "1", "--out-dir", str(run)]) == 0
    return run


def copy_run(run, tmp_path, name="run"):
    return Path(shutil.copytree(run, tmp_path / name))


def contents(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_train_refuses_an_out_dir_holding_a_run(tiny_run, tmp_path, capsys):
    run = copy_run(tiny_run, tmp_path)
    before = contents(run)
    code, _, err = run_cli(capsys, "train", *TINY, "--steps", "2", "--out-dir", str(run))
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"packgraph: error: --out-dir {run} already holds a train run (checkpoint-000001.pt, ")
    assert f"pass --resume {run} to continue it, --overwrite to delete those files first" in err
    assert contents(run) == before  # its log, config and checkpoints as they were
    mine = tmp_path / "mine"  # a dir holding only the user's files holds no run
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    code, _, err = run_cli(capsys, "train", *TINY, "--steps", "1", "--out-dir", str(mine))
    assert code == 0, err
    assert (mine / "notes.txt").read_text() == "mine\n" and len(read_log(mine / "train.jsonl")) == 1


def test_train_overwrite_deletes_the_earlier_run_before_it_starts(tiny_run, tmp_path, capsys, monkeypatch):
    """The issue's case: a new run interrupted in an old run's dir left the old checkpoint.pt beside its log."""
    run = copy_run(tiny_run, tmp_path)
    (run / "notes.txt").write_text("mine\n")

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "step", interrupted)
    argv = ["train", *TINY, "--steps", "3", "--seed", "5", "--overwrite", "--out-dir", str(run)]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 130
    assert f"--overwrite: deleted the earlier train run's files in {run} (checkpoint-000001.pt, " in out
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "notes.txt", "train.jsonl"]
    assert json.loads((run / "config.json").read_text())["seed"] == 5
    assert (run / "train.jsonl").read_text() == "" and (run / "notes.txt").read_text() == "mine\n"


def test_train_resume_continues_its_run_in_its_own_dir_only(tiny_run, tmp_path, capsys):
    run, other = copy_run(tiny_run, tmp_path), copy_run(tiny_run, tmp_path, "other")
    code, _, err = run_cli(capsys, "train", *TINY, "--steps", "3", "--resume", str(other), "--out-dir", str(run))
    assert code == 2 and "already holds a train run (" in err and f"--resume {other} is not a checkpoint of it" in err
    code, _, err = run_cli(
        capsys, "train", *TINY, "--steps", "3", "--resume", str(run), "--overwrite", "--out-dir", str(run)
    )
    assert code == 2 and f"--overwrite would delete {(run / 'checkpoint.pt').resolve()}" in err
    assert contents(run) == contents(other)  # both refusals left the run as it was
    first = str(run / "checkpoint-000001.pt")
    code, _, err = run_cli(capsys, "train", *TINY, "--steps", "3", "--resume", first, "--out-dir", str(run))
    assert code == 0, err
    rows = read_log(run / "train.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]  # cut after the checkpoint's step, then continued
    assert rows[0] == read_log(other / "train.jsonl")[0]
    assert load_checkpoint(run)["step"] == 3


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda c: c["model"].pop("embed.weight"), "model state does not fit the model: missing embed.weight"),
        (lambda c: c["data"].pop("position"), "data is missing position"),
        (lambda c: c["rng"].update(torch=torch.zeros(10, dtype=torch.uint8)), "rng['torch'] is not a CPU generator"),
        (lambda c: c.update(step=-1), "step is -1, not a count of steps done"),
        (lambda c: c.update(train_config=[1]), "train_config is a list, not a dict"),
    ],
    ids=["model state incomplete", "data keys missing", "bad RNG state", "negative step", "train_config a list"],
)
def test_train_resume_from_a_damaged_checkpoint_is_one_line_and_changes_nothing(
    tiny_run, tmp_path, capsys, damage, message
):
    run = copy_run(tiny_run, tmp_path)
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    damage(ckpt)
    torch.save(ckpt, run / "checkpoint.pt")
    before, fresh = contents(run), tmp_path / "fresh"
    for out_dir in (fresh, run):  # a new run dir, then in place
        code, _, err = run_cli(capsys, "train", *TINY, "--steps", "4", "--resume", str(run), "--out-dir", str(out_dir))
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
        assert err.startswith("packgraph: error: checkpoint ") and message in err, err
    assert not fresh.exists()  # no empty out dir left behind
    assert contents(run) == before  # the run it would have continued: log, config and checkpoints untouched


def test_train_overwrite_with_a_refused_checkpoint_deletes_nothing(tiny_run, tmp_path, capsys):
    """--overwrite deletes the earlier run's files only once the run can start: a --resume checkpoint that is
    refused leaves that run as it was."""
    run, other = copy_run(tiny_run, tmp_path), copy_run(tiny_run, tmp_path, "other")
    ckpt = torch.load(other / "checkpoint.pt", weights_only=True)
    ckpt["data"].pop("position")
    torch.save(ckpt, other / "checkpoint.pt")
    before = contents(run)
    argv = ["train", *TINY, "--steps", "4", "--resume", str(other), "--overwrite", "--out-dir", str(run)]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and "data is missing position" in err and "--overwrite: deleted" not in out
    assert contents(run) == before


def test_score_names_what_does_not_fit_in_a_checkpoints_model_on_one_line(tiny_run, tmp_path, capsys):
    ckpt = torch.load(tiny_run / "checkpoint.pt", weights_only=True)
    ckpt["model"]["embed.weight"] = torch.zeros(3)
    bad = tmp_path / "bad.pt"
    torch.save(ckpt, bad)
    code, _, err = run_cli(
        capsys, "score", "--device", "cpu", "--checkpoint", str(bad), "--out-dir", str(tmp_path / "s")
    )
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"{bad}: model state does not fit the model: embed.weight is (3,), not (" in err


def test_score_refuses_an_out_dir_holding_a_score_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "s"
    out.mkdir()
    (out / "score.json").write_text("{}\n")
    (out / "notes.txt").write_text("mine\n")
    argv = ["score", "--device", "cpu", "--T", "128", "--max-docs", "3", "--batches", "1", "--out-dir", str(out)]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and f"--out-dir {out} already holds a score run (score.json): pass --overwrite" in err
    assert (out / "score.json").read_text() == "{}\n"
    code, _, err = run_cli(capsys, *argv, "--overwrite")
    assert code == 0, err
    assert json.loads((out / "score.json").read_text())["batches"] == 1
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "score.json"]


def test_demo_out_dirs_default_new_given_refused_unless_overwrite(tmp_path, capsys, monkeypatch):
    """The demo's own run is tested above; here a stand-in writes what it writes, so only the out dir rule runs."""

    def run_demo(cfg, scopes, echo):
        out = Path(cfg.out_dir)
        (out / "eager").mkdir()
        for name in ("config.json", "train.jsonl", "summary.json"):
            (out / "eager" / name).write_text("{}\n")
        (out / "demo.json").write_text("{}\n")

    monkeypatch.setattr("packgraph.train.demo.run_demo", run_demo)
    monkeypatch.chdir(tmp_path)
    for _ in range(2):  # the default out dir is a new one each time, however fast the second run comes
        code, _, err = run_cli(capsys, "demo", "--device", "cpu")
        assert code == 0, err
    assert len(list((tmp_path / "runs").iterdir())) == 2
    out = tmp_path / "d"
    code, _, err = run_cli(capsys, "demo", "--device", "cpu", "--out-dir", str(out))
    assert code == 0, err
    (out / "notes.txt").write_text("mine\n")
    code, _, err = run_cli(capsys, "demo", "--device", "cpu", "--out-dir", str(out))
    assert code == 2 and "already holds a demo run (demo.json, eager/config.json, eager/summary.json" in err
    code, out_text, err = run_cli(capsys, "demo", "--device", "cpu", "--out-dir", str(out), "--overwrite")
    assert code == 0, err  # the stand-in's mkdir of eager/ passes: --overwrite removed the dir it emptied
    assert "--overwrite: deleted the earlier demo run's files" in out_text
    assert (out / "notes.txt").read_text() == "mine\n"


def test_help_and_nproc_forwarding(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    for command in ("demo", "train", "score", "bench", "plot-convergence"):
        assert command in out
    code, out, _ = run_cli(capsys, "train", "--help")
    assert code == 0 and "--nproc" in out and "--max-seqlen-ladder" in out and "--no-graphs" in out
    # what `packgraph train --nproc N ...` hands to torchrun: the options without --nproc
    forwarded = torchrun_command(2, ["--steps", "5", "--nproc", "2", "--seed", "1"])
    assert forwarded[-4:] == ["--steps", "5", "--seed", "1"] and "--nproc" not in forwarded
    forwarded = torchrun_command(4, ["--nproc=4", "--T", "64"])
    assert forwarded[-2:] == ["--T", "64"] and not any(a.startswith("--nproc=") for a in forwarded)


def test_train_nproc_2_equals_one_process_with_2_micro_batches(tmp_path):
    """`--nproc 2` (torchrun, gloo) = one process accumulating the same two micro-batches per step, with torch DDP
    and with the explicit all-reduce."""
    common = ["train", "--device", "cpu", "--steps", "3", "--T", "128", "--max-docs", "3", "--no-progress"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    runs = (("dp", ["--nproc", "2"]), ("allreduce", ["--nproc", "2", "--dp-engine", "allreduce"]),
            ("accum", ["--grad-accum", "2"]))  # fmt: skip
    for name, extra in runs:
        proc = subprocess.run(
            [sys.executable, "-m", "packgraph", *common, "--out-dir", str(tmp_path / name), *extra],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )
        assert proc.returncode == 0, proc.stdout[-1000:] + proc.stderr[-2000:]
    logs = {n: [json.loads(x) for x in (tmp_path / n / "train.jsonl").read_text().splitlines()] for n, _ in runs}
    assert [r["step"] for r in logs["dp"]] == [1, 2, 3]
    for dp in ("dp", "allreduce"):  # torch DDP (the default) and the explicit all-reduce
        for a, b in zip(logs[dp], logs["accum"], strict=True):
            assert a["tokens"] == b["tokens"] and a["buckets"] == b["buckets"]
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
