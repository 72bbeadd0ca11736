"""The training loop on CPU with the tiny preset: it trains, logs every step, and reads the device once per
logged step."""

import collections
import contextlib
import json
import math
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from packgraph.data.corpus import VOCAB_SIZE
from packgraph.graphs import use_recorder
from packgraph.train import Trainer, train
from packgraph.train.logs import read_log
from packgraph.train.trainer import run_files
from tests.eager_recorder import EagerRecorder
from tests.train.tiny import tiny_cfg


def test_tiny_trains_and_loss_decreases(tmp_path):
    cfg = tiny_cfg(tmp_path, save_checkpoint=False)
    result = train(cfg, echo=None)
    losses = result.losses
    assert len(losses) == 30 and all(math.isfinite(v) for v in losses)
    # An untrained model predicts roughly uniformly over the vocabulary: loss near ln(V).
    assert abs(losses[0] - math.log(VOCAB_SIZE)) < 0.5
    start, end = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert end < start - 0.8, (start, end)

    rows = read_log(result.log_path)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert [r["loss"] for r in rows] == losses
    for i, r in enumerate(rows):
        # The schedule, from its closed form: linear warm-up over 3 steps, cosine to 0.1 * lr at the last step.
        if i < 3:
            want = 3e-3 * (i + 1) / 3
        else:
            want = 3e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (i - 3) / (30 - 1 - 3))))
        assert r["lr"] == pytest.approx(want, rel=1e-12)
        assert r["real_token_fraction"] == pytest.approx(r["tokens"] / 256)
        assert 0 < r["tokens"] <= 256 and r["target_tokens"] < r["tokens"]
        assert r["graphs"] == 0 and r["recaptures"] == 0 and r["step_ms"] > 0
    summary = json.loads((result.out_dir / "summary.json").read_text())
    assert summary["final_loss"] == losses[-1]


# ---------------------------------------------------------------------------------------------- host syncs
# Every way Python code reads a tensor's value on the host: on CUDA each is a device-to-host transfer and a sync.
_HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
}


class HostReads(TorchFunctionMode):
    """Counts host reads of tensor values (and device-to-CPU moves), with the Python line of each."""

    def __init__(self):
        super().__init__()
        self.where = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        moved_to_cpu = func in (torch.Tensor.cpu, torch.Tensor.to) and args[0].device.type != "cpu"
        if func in _HOST_READS or moved_to_cpu:
            caller = traceback.extract_stack(limit=2)[0]
            self.where[f"{func.__name__} at {caller.filename}:{caller.lineno}"] += 1
        return func(*args, **kwargs)

    @property
    def count(self):
        return sum(self.where.values())


@pytest.mark.parametrize("log_every, scope", [(1, None), (3, None), (3, "layer"), (3, "model")])
def test_training_loop_reads_the_device_once_per_logged_step(tmp_path, log_every, scope):
    """One host read per logged step (the run's first, every log_every-th, the last), none in the others, eager and
    graphed (the engine on the CPU stand-in); the values read late are the step's own: those of an eager run that
    reads every step."""
    every = {"log_every": log_every} if log_every > 1 else {}  # 1, the default, is what every run did before
    graphed = {"graphs": True, "scope": scope} if scope else {}
    cfg = tiny_cfg(tmp_path, f"every-{log_every}-{scope}", steps=7, save_checkpoint=False, **every, **graphed)
    with contextlib.ExitStack() as stack:
        if scope:
            stack.enter_context(use_recorder(EagerRecorder()))
        reads = stack.enter_context(HostReads())
        result = train(cfg, echo=None)
    logged = {1, 7} | {s for s in range(1, 8) if s % log_every == 0}
    assert reads.count == len(logged), dict(reads.where)
    met = {tuple(b) for row in read_log(result.log_path) for b in row["buckets"]}  # one graph set per bucket met
    assert result.num_graph_sets == (len(met) if scope else 0)
    if log_every > 1:
        every_step = train(tiny_cfg(tmp_path, "every-step", steps=7, save_checkpoint=False), echo=None)
        assert result.losses == every_step.losses
        same = ("step", "loss", "grad_norm", "lr", "tokens", "target_tokens", "buckets", "epoch")
        for a, b in zip(read_log(result.log_path), read_log(every_step.log_path), strict=True):
            assert {k: a[k] for k in same} == {k: b[k] for k in same}


def test_trainer_steps_read_nothing_until_a_logged_step(tmp_path):
    cfg = tiny_cfg(tmp_path, steps=6, log_every=4, save_checkpoint=False)
    trainer = Trainer(cfg, echo=None)
    per_step = []
    try:
        while not trainer.done:
            with HostReads() as reads:
                trainer.step()
            per_step.append(reads.count)
            assert len(trainer.rows) == {1: 1, 4: 4, 6: 6}.get(trainer.step_index, len(trainer.rows))
        result = trainer.finish()
    finally:
        trainer.close()
    assert per_step == [1, 0, 0, 1, 0, 1]  # steps 1, 4 (log_every) and 6 (the last)
    assert [r["step"] for r in read_log(result.log_path)] == list(range(1, 7))
    assert all(r["grad_norm"] > 0 and r["step_ms"] > 0 for r in trainer.rows)
    assert result.first_step_s > 0


def test_run_files_lists_every_file_a_run_writes(tmp_path):
    """`packgraph train --overwrite` deletes run_files(out_dir) and nothing else: it must know every file a run
    writes, and no file of the user's."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    (out / "checkpoint-best.pt").write_bytes(b"mine too")
    result = train(tiny_cfg(tmp_path, steps=2, checkpoint_every=1, plot=True, T=128, max_docs=3), echo=None)
    assert result.plot_path is not None
    written = {"config.json", "train.jsonl", "summary.json", "loss.png"}
    written |= {"checkpoint.pt", "checkpoint-000001.pt", "checkpoint-000002.pt"}
    assert {p.name for p in out.iterdir()} == written | {"notes.txt", "checkpoint-best.pt"}
    assert [p.name for p in run_files(out)] == sorted(written)
    (out / "checkpoint.pt.tmp").write_bytes(b"")  # what a kill mid-save leaves
    assert out / "checkpoint.pt.tmp" in run_files(out)
