"""GPU: the graphed GPT equals the eager GPT (loss, grads, logprobs) for every scope, over several packings.

Tolerances: the graphed and eager passes run the same bf16 kernels on the same inputs, so they differ only where a
kernel is itself nondeterministic (FlashAttention's backward accumulates dq with atomics). Loss and logprobs must
agree to 1e-3 absolute; each gradient to 2e-2 of its own max magnitude (bf16 has 8 mantissa bits). The maximum
differences seen are published with `report`.
"""

import itertools
import warnings

import pytest
import torch

from packgraph.buckets import default_buckets
from packgraph.graphs.recorder import CudaRecorder
from packgraph.models.gpt import GPT, SCOPES, GPTConfig
from packgraph.packing import PackedBatch, fixed_shape_sample
from packgraph.score import score
from packgraph.train import (
    DataStream,
    TrainConfig,
    Trainer,
    accumulate_gradients,
    compare_eager_graphed,
    corpus_documents,
    train,
)

T = 1024
LOSS_ATOL = 1e-3
GRAD_RTOL = 2e-2


def model_on_cuda(seed=0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig.preset("tiny", d_model=128, n_layer=3, n_head=4, n_kv_head=2)
    return GPT(cfg).cuda()


def packings() -> list[PackedBatch]:
    """Corpus batches in several buckets, plus synthetic ones: padded layout, a full bin, 1-token documents."""
    cfg = TrainConfig(T=T, max_docs=40, seed=1)
    data = DataStream(corpus_documents(cfg), T=T, policy=cfg.bucket_policy(), seed=1)
    batches = list(itertools.islice(data, 6))
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in (1, 1, 300, 2, 500)]
    batches.append(PackedBatch.from_documents(docs, bin_size=T, capacity=8, max_seqlen=512))
    batches.append(fixed_shape_sample(T, 8, max_seqlen=T, seed=3))
    batches.append(fixed_shape_sample(T, 32, max_seqlen=256, seed=4))
    return batches


def loss_and_grads(model, runner, batch):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        _, loss = runner(batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach().float().clone(), grads


@pytest.mark.parametrize("scope", SCOPES)
def test_graphed_equals_eager_loss_and_grads(scope, report):
    model = model_on_cuda()
    graphed = model.graphed(scope=scope)
    worst_loss, worst_grad = 0.0, 0.0
    for batch in packings():
        batch = batch.to("cuda")
        eager_loss, eager_grads = loss_and_grads(model, model, batch)
        for _ in range(2):  # the first call captures, the second replays
            g_loss, g_grads = loss_and_grads(model, graphed, batch)
            assert torch.isfinite(g_loss)
            worst_loss = max(worst_loss, float((g_loss - eager_loss).abs()))
            assert float((g_loss - eager_loss).abs()) <= LOSS_ATOL, (scope, batch.bucket)
            for name, e in eager_grads.items():
                diff = float((g_grads[name] - e).abs().max())
                scale = float(e.abs().max()) + 1e-6
                worst_grad = max(worst_grad, diff / scale)
                assert torch.isfinite(g_grads[name]).all(), name
                assert diff <= GRAD_RTOL * scale, (scope, name, diff, scale)
    report(f"gpt graphed[{scope}] vs eager: max |loss diff|", worst_loss)
    report(f"gpt graphed[{scope}] vs eager: max grad diff / max |grad|", worst_grad)
    report(f"gpt graphed[{scope}]: graph sets captured", graphed.num_graph_sets)
    # Graph sets are per static signature: never more than the distinct signatures seen.
    distinct = {(b.static_signature()) for b in packings()}
    assert graphed.num_graph_sets <= (1 if scope == "mlp" else len(distinct))


@pytest.mark.parametrize("scope", SCOPES)
def test_graphed_with_a_frozen_embedding_equals_eager(scope, report):
    """LoRA-style fine-tuning freezes the embedding, so the first block's input stops requiring grad: a new
    signature for the head of the stack alone, whose graph must not share a pool with the later blocks' older
    graphs. Losses and grads eager's, and no grad for the embedding, over every bucket of the packings."""
    model = model_on_cuda(2)
    model.embed.weight.requires_grad_(False)
    graphed = model.graphed(scope=scope)
    worst = 0.0
    for batch in packings():
        batch = batch.to("cuda")
        eager_loss, eager_grads = _loss_and_trainable_grads(model, model, batch)
        for _ in range(2):
            g_loss, g_grads = _loss_and_trainable_grads(model, graphed, batch)
            assert g_grads.keys() == eager_grads.keys() and "embed.weight" not in g_grads
            assert float((g_loss - eager_loss).abs()) <= LOSS_ATOL, (scope, batch.bucket)
            for name, e in eager_grads.items():
                scale = float(e.abs().max()) + 1e-6
                worst = max(worst, float((g_grads[name] - e).abs().max()) / scale)
    report(f"gpt graphed[{scope}] frozen embedding vs eager: max grad diff / max |grad|", worst)
    assert worst <= GRAD_RTOL


def _loss_and_trainable_grads(model, runner, batch):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        _, loss = runner(batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach().float().clone(), grads


def test_graphed_with_bucket_policy_equals_eager(report):
    """Raw batches (max_seqlen = T, few slots) mapped to buckets by the wrapper."""
    model = model_on_cuda(1)
    graphed = model.graphed(scope="layer", buckets=default_buckets(T))
    worst = 0.0
    g = torch.Generator().manual_seed(5)
    for lengths in ([100, 3, 700], [1000], [50] * 20, [8, 9], [255, 256, 1, 1]):
        docs = [torch.randint(0, 256, (n,), generator=g) for n in lengths]
        batch = PackedBatch.from_documents(docs, bin_size=T, capacity=len(lengths)).to("cuda")
        eager_loss, _ = loss_and_grads(model, model, batch)
        g_loss, _ = loss_and_grads(model, graphed, batch)
        worst = max(worst, float((g_loss - eager_loss).abs()))
        assert worst <= LOSS_ATOL
    report("gpt graphed[layer]+buckets vs eager: max |loss diff|", worst)
    report("gpt graphed[layer]+buckets: graph sets for 5 batches", graphed.num_graph_sets)


def test_graphed_grad_accumulation_equals_eager(report):
    model = model_on_cuda(2)
    graphed = model.graphed(scope="layer")
    micro = packings()[:3]
    device = torch.device("cuda")
    model.zero_grad(set_to_none=True)
    eager_loss = accumulate_gradients(model, micro, device)
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    accumulate_gradients(graphed, micro, device)  # captures
    model.zero_grad(set_to_none=True)
    g_loss = accumulate_gradients(graphed, micro, device)
    worst = 0.0
    for n, p in model.named_parameters():
        diff, scale = float((p.grad - eager[n]).abs().max()), float(eager[n].abs().max()) + 1e-6
        worst = max(worst, diff / scale)
        assert diff <= GRAD_RTOL * scale, n
    assert float((g_loss - eager_loss).abs()) <= LOSS_ATOL
    report("gpt graphed grad accumulation (3 micro-batches): max grad diff / max |grad|", worst)


@pytest.mark.parametrize("scope", ["layer", "model"])
def test_score_graphed_equals_eager(scope, report):
    model = model_on_cuda(3)
    result = score(model, packings(), graphed=True, scope=scope)
    assert result.max_abs_diff is not None and result.max_abs_diff <= LOSS_ATOL
    for lp, b in zip(result.logprobs, packings(), strict=True):
        assert lp.shape == (T,) and torch.all(lp[b.labels == -100] == 0) and torch.isfinite(lp).all()
    report(f"score graphed[{scope}] vs eager: max |logprob diff|", result.max_abs_diff)
    report(f"score graphed[{scope}]: speedup over eager", round(result.speedup, 2))


def tiny_run(tmp_path, steps: int, **overrides) -> TrainConfig:
    """A short `tiny` training run on the corpus stream (several buckets), artefacts under ``tmp_path``."""
    return TrainConfig(
        preset="tiny",
        steps=steps,
        T=T,
        lr=3e-3,
        warmup_steps=3,
        max_docs=40,
        device="cuda",
        out_dir=str(tmp_path),
        progress=False,
        plot=False,
        save_checkpoint=False,
        **overrides,
    )


def test_short_training_run_graphed_tracks_eager(tmp_path, report):
    cfg = tiny_run(tmp_path, 30)
    out = compare_eager_graphed(cfg, scopes=("layer", "attn"), echo=None)
    eager = out["runs"]["eager"]
    assert sum(eager.losses[-5:]) < sum(eager.losses[:5]) - 2.5  # the loss clearly drops (5 steps each)
    for name in ("graphed-layer", "graphed-attn"):
        run = out["runs"][name]
        assert run.graphs and run.num_graph_sets >= 1
        # Same data and init; bf16 noise may grow over steps but stays small over 30 steps.
        assert out["max_abs_loss_diff"][name] <= 5e-2, name
        report(f"train 30 steps tiny: max |loss diff| {name} vs eager", out["max_abs_loss_diff"][name])
        report(f"train 30 steps tiny: tokens/s speedup {name}", round(out["speedup"][name], 2))
    assert not eager.graphs and eager.num_graph_sets == 0


def test_deterministic_runs_are_bitwise_equal_eager_and_graphed(tmp_path, report):
    """With deterministic kernels, eager, graphed-layer, graphed-attn and graphed-model runs give the same losses
    bit for bit, over a stream that visits several buckets (so graphs are recaptured mid-run)."""
    cfg = tiny_run(tmp_path, 25, deterministic=True)
    out = compare_eager_graphed(cfg, scopes=("layer", "attn", "model"), echo=None)
    eager = out["runs"]["eager"].losses
    assert not torch.are_deterministic_algorithms_enabled()  # restored after each run
    for name in ("graphed-layer", "graphed-attn", "graphed-model"):
        run = out["runs"][name]
        report(f"deterministic 25 steps tiny: max |loss diff| {name} vs eager", out["max_abs_loss_diff"][name])
        assert run.num_graph_sets >= 2, name  # several buckets met, so captures happened mid-run
        assert run.losses == eager, name


def _fill_and_free(nbytes: int, device: torch.device) -> None:
    """Leave a cached free block of ``nbytes`` holding NaN on the current stream (and pool): the next allocations
    there are carved from it. (Memory given back to the driver comes back zeroed, so ``empty_cache`` must not run.)"""
    torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(float("nan"))


def _poisoned_warmups(monkeypatch, nbytes: int = 256 << 20) -> list[bool]:
    """Before each warm-up, fill ``nbytes`` on the capture stream with NaN and free it, inside the graphs' pool
    (where warm-ups and captures allocate) and outside it (where the eager code around the graphs allocates).
    Returns, per warm-up, whether a fresh 4 MiB tensor of the pool read NaN (the poison took)."""
    original = CudaRecorder.warmup
    took = []

    def warmup(self, run, iters, pool=None):
        torch.cuda.synchronize(self.device)
        with torch.cuda.stream(self.stream):
            _fill_and_free(nbytes, self.device)
            with self._allocating_in(pool or self.pool):
                _fill_and_free(nbytes, self.device)
                took.append(bool(torch.empty(1 << 20, device=self.device).isnan().all()))
        torch.cuda.synchronize(self.device)
        original(self, run, iters, pool)

    monkeypatch.setattr(CudaRecorder, "warmup", warmup)
    return took


def test_graphed_training_reads_no_memory_it_did_not_write(tmp_path, monkeypatch, report):
    """Before every warm-up (so before every capture) the graphs' pool and the capture stream get a cached block full
    of NaN, which the capture's allocations reuse; eager's run gets the same on its stream. A graph, or the eager
    code around it, that read memory no kernel of the step wrote would make a loss NaN or change it. Deterministic
    losses of each scope must still equal eager's bit for bit, over a stream that captures buckets mid-run."""
    took = _poisoned_warmups(monkeypatch)
    runs = {}
    # The scopes of the unpoisoned deterministic test above (scope "mlp" has one graph set: no mid-run capture).
    scopes = ("layer", "attn", "model")
    configs = [("eager", {"graphs": False})] + [(f"graphed-{s}", {"graphs": True, "scope": s}) for s in scopes]
    for name, overrides in configs:
        _fill_and_free(256 << 20, torch.device("cuda"))
        runs[name] = train(tiny_run(tmp_path / name, 25, deterministic=True, **overrides), echo=None)
    assert took and took[0], "the first warm-up's pool did not hand out the NaN block: nothing was poisoned"
    eager = runs["eager"].losses
    assert all(loss == loss for loss in eager)  # no NaN in the reference
    for name, run in runs.items():
        if name != "eager":
            assert run.num_graph_sets >= 2, name
            assert run.losses == eager, name
    report("poisoned pools: warm-ups whose pool handed out NaN", f"{sum(took)} / {len(took)}")


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphed-layer"])
def test_training_steps_sync_only_when_logged(tmp_path, graphs, report):
    """torch's sync debug mode flags every synchronizing CUDA call. In the steady state (after three steps of lazy
    initialisation and, graphed, the capture of the one bucket and its first replay) a step syncs once when it is
    logged (every 4th and the last) and never otherwise: batches go up from pinned memory, step times are CUDA
    events."""
    cfg = tiny_run(tmp_path, 12, graphs=graphs, log_every=4, max_seqlen_ladder=(T,), capacity_ladder=(64,))
    trainer = Trainer(cfg, echo=None)
    per_step, messages = [], []
    try:
        for _ in range(3):  # lazy initialisation (the fused optimizer's first steps, the capture) comes first
            trainer.step()
        torch.cuda.synchronize()
        while not trainer.done:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    trainer.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            # torch's once-per-process notice that the mode is a prototype also says "synchronizing": counted, it
            # failed this test whenever it was the first in its process to enable the mode.
            syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
            per_step.append(len(syncs))
            messages += syncs
        result = trainer.finish()
    finally:
        trainer.close()
    assert per_step == [1 if s % 4 == 0 or s == 12 else 0 for s in range(4, 13)], (per_step, messages[:3])
    assert len(result.losses) == 12 and all(r["step_ms"] > 0 for r in trainer.rows)
    assert result.num_graph_sets == (1 if graphs else 0)
    report(f"train tiny ({'graphed' if graphs else 'eager'}): syncs in steps 4-12 with log_every=4", sum(per_step))
