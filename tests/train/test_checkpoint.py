"""Checkpoints and resume, on CPU with the tiny preset: bitwise continuation, refusal of foreign, crafted,
mismatched and damaged checkpoints, checkpoints that are data only, and saves that fail midway."""

import copy
import io
import os
import random
from pathlib import Path

import pytest
import torch

from packgraph.train import Trainer, load_checkpoint, train
from packgraph.train.checkpoint import restore_training_state
from packgraph.train.logs import read_log
from tests.train.tiny import tiny_cfg


def test_resume_continues_the_same_loss_curve_bitwise(tmp_path):
    full = train(tiny_cfg(tmp_path, "full", steps=10, checkpoint_every=5), echo=None)
    resumed = train(
        tiny_cfg(tmp_path, "resumed", steps=10, resume=str(tmp_path / "full" / "checkpoint-000005.pt")), echo=None
    )
    assert resumed.first_step == 5
    assert resumed.losses == full.losses[5:]  # bitwise: same params, optimizer, schedule, RNG and batches
    a = torch.load(full.checkpoint_path, weights_only=True)  # checkpoints are data: tensors and plain values
    b = torch.load(resumed.checkpoint_path, weights_only=True)
    assert a["step"] == b["step"] == 10 and a["data"] == b["data"]
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name
    assert [r["step"] for r in read_log(resumed.log_path)] == list(range(6, 11))


def test_resume_into_the_same_dir_logs_each_step_once(tmp_path):
    train(tiny_cfg(tmp_path, "run", steps=6, checkpoint_every=3), echo=None)
    resumed = train(
        tiny_cfg(tmp_path, "run", steps=6, resume=str(tmp_path / "run" / "checkpoint-000003.pt")), echo=None
    )
    assert [r["step"] for r in read_log(resumed.log_path)] == list(range(1, 7))


@pytest.mark.parametrize("change", [{"seed": 7}, {"T": 128}, {"max_docs": 10}, {"grad_accum": 2}])
def test_resume_rejects_settings_that_change_the_data_order(tmp_path, change):
    train(tiny_cfg(tmp_path, "a", steps=2), echo=None)
    with pytest.raises(ValueError, match="cannot resume") as e:
        train(tiny_cfg(tmp_path, "b", steps=4, resume=str(tmp_path / "a"), **change), echo=None)
    assert next(iter(change)) in str(e.value)


def test_resume_rejects_foreign_and_corrupt_checkpoints(tmp_path):
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(2)}, foreign)
    with pytest.raises(ValueError, match="not a packgraph training checkpoint"):
        train(tiny_cfg(tmp_path, "b", resume=str(foreign)), echo=None)
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_text("garbage\n")
    with pytest.raises(ValueError, match="cannot read checkpoint"):
        train(tiny_cfg(tmp_path, "c", resume=str(corrupt)), echo=None)


def test_resume_rejects_a_different_model(tmp_path):
    train(tiny_cfg(tmp_path, "a", steps=2), echo=None)
    with pytest.raises(ValueError, match="different model"):
        train(tiny_cfg(tmp_path, "b", steps=4, model_overrides={"n_layer": 3}, resume=str(tmp_path / "a")), echo=None)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(tiny_cfg(tmp_path, "c", resume=str(tmp_path / "missing")), echo=None)


# ---------------------------------------------------------------------------------------------- checkpoints are data
class RunsCode:
    """Unpickling this object runs code: it writes a marker file (what a malicious checkpoint would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_a_checkpoint_whose_unpickling_runs_code_is_refused(tmp_path):
    train(tiny_cfg(tmp_path, "a", steps=2), echo=None)
    good = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)
    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil.pt"
    torch.save({**good, "rng": {**good["rng"], "python": RunsCode(marker)}}, evil)  # every key a checkpoint has
    with pytest.raises(ValueError, match=r"refusing to load .*evil.pt: it holds a pickled Python object \(exec\)") as e:
        train(tiny_cfg(tmp_path, "b", steps=4, resume=str(evil)), echo=None)
    assert "weights_only=False" in str(e.value)  # says what a user who trusts the file can do
    assert not marker.exists()
    with pytest.raises(ValueError, match="refusing to load"):
        load_checkpoint(evil)
    assert not marker.exists()


def test_checkpoint_of_a_config_with_a_path_out_dir_loads_as_data_and_resumes(tmp_path):
    """A Path in the config (not a type weights_only accepts) is saved as its string; resume still works."""
    full = train(tiny_cfg(tmp_path, steps=4, checkpoint_every=2, out_dir=tmp_path / "p"), echo=None)
    ckpt = load_checkpoint(tmp_path / "p" / "checkpoint-000002.pt")
    assert ckpt["train_config"]["out_dir"] == str(tmp_path / "p")
    assert isinstance(ckpt["rng"]["python"], list)  # the Python RNG state as plain lists
    resumed = train(tiny_cfg(tmp_path, "r", steps=4, resume=str(tmp_path / "p" / "checkpoint-000002.pt")), echo=None)
    assert resumed.losses == full.losses[2:]


# ---------------------------------------------------------------------------------------------- atomic writes
def _save_half_then_fail(real_save, calls, fail_at):
    """A torch.save that, at call ``fail_at``, writes half of the file and raises (a full disk, or a kill mid-save)."""

    def save(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) != fail_at:
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        half = buffer.getvalue()[: len(buffer.getvalue()) // 2]
        if isinstance(f, (str, os.PathLike)):
            Path(f).write_bytes(half)
        else:
            f.write(half)
        raise OSError(28, "No space left on device")

    return save


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint_and_no_temp_file(tmp_path, monkeypatch):
    calls = []
    # Saves per step with checkpoint_every=1: checkpoint.pt, then checkpoint-<step>.pt. The third is step 2's.
    monkeypatch.setattr(torch, "save", _save_half_then_fail(torch.save, calls, fail_at=3))
    with pytest.raises(OSError, match="No space left"):
        train(tiny_cfg(tmp_path, steps=3, checkpoint_every=1, T=128, max_docs=3), echo=None)
    assert len(calls) == 3
    run = tmp_path / "run"
    assert load_checkpoint(run)["step"] == 1  # step 1's checkpoint, whole
    assert sorted(p.name for p in run.iterdir()) == [
        "checkpoint-000001.pt",
        "checkpoint.pt",
        "config.json",
        "train.jsonl",
    ]


# ---------------------------------------------------------------------------------------------- damaged checkpoints
@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A tiny run's checkpoint after 2 steps, and a trainer of the same config (its parts to restore into)."""
    tmp = tmp_path_factory.mktemp("saved")
    train(tiny_cfg(tmp, "a", steps=2, T=128, max_docs=3), echo=None)
    trainer = Trainer(tiny_cfg(tmp, "b", steps=4, T=128, max_docs=3), echo=None)
    yield load_checkpoint(tmp / "a"), trainer
    trainer.close()


def _set(path, value):
    """A change to a checkpoint: set the value at ``path`` (keys into nested dicts), or delete it (``DELETE``)."""

    def change(ckpt):
        *parents, last = path
        for key in parents:
            ckpt = ckpt[key]
        if value is DELETE:
            del ckpt[last]
        else:
            ckpt[last] = value(ckpt[last]) if callable(value) else value

    return change


DELETE = object()
FIRST_KEY = "embed.weight"
DAMAGES = {
    "model state incomplete": (
        _set(("model", FIRST_KEY), DELETE),
        f"model state does not fit the model: missing {FIRST_KEY}",
    ),
    "model state with an extra key": (_set(("model", "extra.weight"), torch.zeros(2)), "unexpected extra.weight"),
    "model tensor of another shape": (_set(("model", FIRST_KEY), torch.zeros(3)), f"{FIRST_KEY} is (3,), not ("),
    "model not a dict": (_set(("model",), [1, 2]), "model is a list, not a state dict"),
    "optimizer not a state dict": (
        _set(("optimizer",), {"param_groups": []}),
        "optimizer is not an optimizer state dict",
    ),
    "optimizer with a group less": (
        _set(("optimizer", "param_groups"), lambda g: g[:1]),
        "optimizer has 1 parameter groups",
    ),
    "optimizer moment of another shape": (
        _set(("optimizer", "state", 0, "exp_avg"), torch.zeros(1, 1)),
        "optimizer state 'exp_avg' of parameter 0 is (1, 1)",
    ),
    "scheduler not a dict": (_set(("scheduler",), None), "scheduler is a NoneType, not a state dict"),
    "scheduler at a negative step": (_set(("scheduler", "last_epoch"), -1), "scheduler's last_epoch is -1"),
    "data missing a key": (_set(("data", "position"), DELETE), "data is missing position"),
    "data not a dict": (_set(("data",), [0, 2]), "data is a list"),
    "data position not an int": (_set(("data", "position"), "2"), "data position is '2', not an int >= 0"),
    "torch RNG state of another size": (
        _set(("rng", "torch"), torch.zeros(10, dtype=torch.uint8)),
        r"rng['torch'] is not a CPU generator state",
    ),
    "torch RNG state not a tensor": (_set(("rng", "torch"), [1, 2]), "rng['torch'] is not a CPU generator state"),
    "python RNG state cut short": (_set(("rng", "python"), lambda s: [s[0], s[1][:10], s[2]]), "rng['python'] is not"),
    "RNG state missing": (_set(("rng",), {}), "rng is not an RNG state"),
    "negative step": (_set(("step",), -1), "step is -1, not a count of steps done"),
    "step not an int": (_set(("step",), 1.5), "step is 1.5, not a count of steps done"),
    "step a bool": (_set(("step",), True), "step is True"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_checkpoint_is_refused_with_one_line_naming_it_before_anything_is_restored(saved_run, damage):
    good, trainer = saved_run
    change, message = DAMAGES[damage]
    ckpt = copy.deepcopy(good)
    change(ckpt)
    parts = trainer._state_parts()
    before = (
        {k: v.clone() for k, v in trainer.model.state_dict().items()},
        copy.deepcopy(trainer.optimizer.state_dict()),
        trainer.scheduler.state_dict(),
        trainer.data.state_dict(),
        torch.get_rng_state(),
        random.getstate(),
    )
    with pytest.raises(ValueError) as e:
        restore_training_state(ckpt, **parts)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    state, optimizer, scheduler, data, torch_rng, python_rng = before
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert trainer.optimizer.state_dict()["state"] == optimizer["state"] == {}
    assert trainer.scheduler.state_dict() == scheduler and trainer.data.state_dict() == data
    assert torch.equal(torch.get_rng_state(), torch_rng) and random.getstate() == python_rng


def test_a_resume_refused_leaves_no_out_dir(saved_run, tmp_path):
    good, _ = saved_run
    bad = tmp_path / "bad.pt"
    torch.save({**good, "step": -3}, bad)
    with pytest.raises(ValueError, match=r"bad.pt: step is -3"):
        train(tiny_cfg(tmp_path, "resumed", steps=4, T=128, max_docs=3, resume=str(bad)), echo=None)
    assert not (tmp_path / "resumed").exists()
