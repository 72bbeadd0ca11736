"""Training loop, data pipeline, checkpoint/resume and log tools, on CPU with the tiny preset."""

import collections
import contextlib
import json
import math
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from packgraph.data.corpus import VOCAB_SIZE, load_corpus
from packgraph.data.stream import DataStream, corpus_documents, split_documents
from packgraph.graphs import use_recorder
from packgraph.models.gpt import GPT
from packgraph.train import TrainConfig, Trainer, accumulate_gradients, load_checkpoint, train
from packgraph.train.logs import convergence_report, ema, read_log, throughput
from tests.eager_recorder import EagerRecorder


def tiny_cfg(tmp_path, name="run", **kw) -> TrainConfig:
    base = dict(
        preset="tiny",
        steps=30,
        T=256,
        lr=3e-3,
        warmup_steps=3,
        max_docs=20,
        device="cpu",
        out_dir=str(tmp_path / name),
        progress=False,
        plot=False,
    )
    base.update(kw)
    return TrainConfig(**base)


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


@pytest.mark.parametrize("multiple", [1, 4])
def test_labels_never_cross_documents(multiple):
    """Through the whole pipeline: every target is the next token of the same document, checked from offsets."""
    cfg = TrainConfig(T=512, max_docs=15, seed=3, pad_to_multiple=multiple)
    docs = corpus_documents(cfg)
    data = DataStream(docs, T=512, policy=cfg.bucket_policy(), seed=3, pad_to_multiple=multiple)
    checked = 0
    for _ in range(12):
        b = next(data)
        host = b.packed_seq_params.host_offsets
        real = host["cu_seqlens_q"]
        layout = host.get("cu_seqlens_q_padded", real)
        owner = torch.full((512,), -1)
        for i in range(len(b.doc_lengths)):
            n = real[i + 1] - real[i]
            owner[layout[i] : layout[i] + n] = i
        for r in range(512):
            if b.labels[r] != -100:
                assert r + 1 < 512 and owner[r] >= 0 and owner[r + 1] == owner[r], r
                assert b.labels[r] == b.tokens[r + 1]
                checked += 1
            elif owner[r] >= 0:
                assert r + 1 == 512 or owner[r + 1] != owner[r]  # only a document's last token lacks a target
        assert torch.equal(b.loss_mask, (b.labels != -100).float())
        assert b.loss_mask.sum() == b.num_real_tokens
        # Each document in the batch is one contiguous piece of a corpus file.
        for i in range(len(b.doc_lengths)):
            piece = b.tokens[layout[i] : layout[i] + real[i + 1] - real[i]]
            assert any(torch.equal(piece, d) for d in docs if d.numel() == piece.numel())
    assert checked > 12 * 400 // multiple


def test_split_documents_keeps_every_token():
    docs = load_corpus(max_docs=5)
    pieces = split_documents(docs, 300, min_len=40, seed=1)
    assert torch.equal(torch.cat(pieces), torch.cat(docs))
    assert all(1 <= p.numel() <= 300 for p in pieces)
    inner = [p.numel() for p in pieces if p.numel() < 40]
    assert len(inner) <= len(docs)  # only a file's last piece may be shorter than min_len
    assert [p.numel() for p in split_documents(docs, 300, min_len=40, seed=1)] == [p.numel() for p in pieces]
    want = []
    for d in docs:
        n = d.numel()
        want += [300] * (n // 300) + ([n % 300] if n % 300 else [])
    assert [p.numel() for p in split_documents(docs, 300)] == want


def test_data_stream_is_deterministic_and_visits_every_bin_once_per_epoch():
    cfg = TrainConfig(T=256, max_docs=6)
    docs = corpus_documents(cfg)
    a = DataStream(docs, T=256, policy=cfg.bucket_policy(), seed=5)
    b = DataStream(docs, T=256, policy=cfg.bucket_policy(), seed=5)
    n = a.bins_per_epoch
    seen = []
    for _ in range(n):
        x, y = next(a), next(b)
        assert torch.equal(x.tokens, y.tokens)
        seen.append(x.tokens)
    bins = {tuple(t.tolist()) for t in seen}
    assert len(bins) == n  # a permutation of the bins: nothing repeated or skipped
    first_of_epoch_1 = next(a)
    assert a.state_dict() == {"epoch": 1, "position": 1}
    assert tuple(first_of_epoch_1.tokens.tolist()) in bins
    # Restoring a position gives exactly the batch that came next.
    c = DataStream(docs, T=256, policy=cfg.bucket_policy(), seed=5)
    c.load_state_dict({"epoch": 0, "position": 3})
    assert torch.equal(next(c).tokens, seen[3])
    other = DataStream(docs, T=256, policy=cfg.bucket_policy(), seed=6)
    assert not all(torch.equal(next(other).tokens, s) for s in seen[:3])


def test_grad_accumulation_equals_one_big_batch():
    cfg = TrainConfig(T=128, max_docs=4, seed=1)
    data = DataStream(corpus_documents(cfg), T=128, policy=cfg.bucket_policy(), seed=1)
    micro = [next(data) for _ in range(3)]
    torch.manual_seed(0)
    model = GPT(cfg.model_config()).double()
    loss = accumulate_gradients(model, micro, torch.device("cpu"))
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    # Reference: CE summed over every target of the three batches, divided by their count.
    model.zero_grad(set_to_none=True)
    ce_sum, count = 0.0, 0
    for b in micro:
        logits = model(b.tokens, b.packed_seq_params)
        ce_sum = ce_sum + F.cross_entropy(logits, b.labels, ignore_index=-100, reduction="sum")
        count += int((b.labels != -100).sum())
    ref = ce_sum / count
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-9, atol=1e-12, msg=n)


def test_config_validation():
    with pytest.raises(ValueError, match="unknown preset"):
        TrainConfig(preset="nope").validate()
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0).validate()
    with pytest.raises(ValueError, match="above T"):
        TrainConfig(T=256, max_seqlen_ladder=(128, 512)).validate()
    with pytest.raises(ValueError, match="strictly increasing"):
        TrainConfig(capacity_ladder=(8, 8)).validate()
    with pytest.raises(ValueError, match="CUDA"):
        train(TrainConfig(graphs=True, device="cpu", steps=1))


def test_ema_and_convergence_report(tmp_path):
    values = [5.0, 4.0, 3.5, 3.0]
    # Independent: the debiased EMA is the weighted mean with weights beta^(t-i).
    for t in range(1, 5):
        w = [0.9 ** (t - i) for i in range(1, t + 1)]
        want = sum(wi * v for wi, v in zip(w, values[:t], strict=True)) / sum(w)
        assert ema(values, 0.9)[t - 1] == pytest.approx(want, rel=1e-12)
    ref = [{"step": s, "loss": 4.0 - 0.1 * s, "tokens": 100, "step_ms": 10.0} for s in range(1, 21)]
    off = [dict(r, loss=r["loss"] * 1.02, step_ms=5.0) for r in ref]
    report = convergence_report({"eager": ref, "graphed": off}, beta=0.9)
    assert report["max_rel_diff"]["graphed"] == pytest.approx(0.02, rel=1e-9)
    assert report["tokens_per_s"]["eager"] == pytest.approx(10_000)
    assert report["tokens_per_s"]["graphed"] == pytest.approx(20_000)
    assert report["final_loss"]["eager"] == pytest.approx(2.0) and report["common_steps"] == 20

    # Steady throughput leaves out warm-up steps and steps that captured graphs; overall keeps everything.
    rows = [{"tokens": 100, "step_ms": 10.0, "captures": 1} for _ in range(20)]
    rows[0] = dict(rows[0], step_ms=5000.0)  # first step: warm-up + first capture
    rows[12] = {"tokens": 100, "step_ms": 900.0, "captures": 2}  # a new bucket captured here
    rows[13:] = [dict(r, captures=2) for r in rows[13:]]
    steady, overall = throughput(rows)
    assert steady == pytest.approx(100 / 0.01)
    assert overall == pytest.approx(2000 / (5.0 + 0.9 + 18 * 0.01))

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "loss": 2.0}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_log(bad)
    with pytest.raises(FileNotFoundError):
        read_log(tmp_path / "missing.jsonl")


def test_deterministic_kernels_mode_is_set_inside_and_restored_after():
    from packgraph.train import deterministic_kernels

    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_kernels(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # warn-only keeps FA's atomics
    assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(RuntimeError, match="boom"), deterministic_kernels(True):
        raise RuntimeError("boom")
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_kernels(False):
        assert not torch.are_deterministic_algorithms_enabled()


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
    assert result.num_graph_sets == (1 if scope else 0)
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
