"""Every family of ``packgraph.integrations.hf_families`` on CUDA, as ``Trainer``'s ``bf16=True`` runs it (bf16
autocast over float32 weights): packed eager against each document alone, and each scope of
``graph_decoder_layers`` (real CUDA graphs) against packed eager.

The families' tiny random configs have windows of 8 tokens and documents of up to 30 (FlashAttention-2 with a
window, Gemma 2's softcap and gpt-oss's sinks all run). The reference for packed eager is each document alone through
transformers' own eager attention in float32, so the tolerance is bf16's. MoE families are compared in float32 (no
autocast, packgraph's exact attention): under bf16 a token whose top-k experts are nearly tied can be routed
differently in the two runs, which moves its output by a whole expert. Graphed replays run packed eager's kernels,
so they agree up to FlashAttention's backward atomics, MoE routes included.

MoE: ``experts_implementation="eager"`` must be refused for whole layers and MoE blocks (host reads), with the hint;
``"batched_mm"`` must capture; ``"grouped_mm"`` (transformers' default) captures where torch runs its fused grouped
GEMM and is refused, with the hint, where torch falls back to a loop that reads the group offsets on the host (float32
weights; also tried with bf16 weights): each outcome is reported, and either passes.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from packgraph.host_syncs import GraphCaptureError  # noqa: E402
from packgraph.integrations import hf  # noqa: E402
from packgraph.integrations.hf_families import (  # noqa: E402
    FAMILIES,
    documents,
    packed_batch,
    per_document_reference,
    random_documents,
    tiny_model,
)

# Relative: max |diff| / max |ref| for logits, |diff| / |ref| for each parameter's grad (the worst is checked). bf16
# autocast against float32 measured 1.0-2.7e-2 (logits) and 1.1-5.4e-2 (grads) on the CPU's bf16 autocast; a window
# off by one token moves these logits by ~1.
ALONE_TOL = {"bf16": dict(logits=5e-2, grads=1e-1), "fp32": dict(logits=1e-4, grads=1e-4)}
GRAPHED_TOL = 2e-2  # graphed against packed eager, same kernels
CAPACITY, MAX_SEQLEN, T = 8, 32, 80


def _batches():
    docs = [documents(), *(random_documents(T, max_seqlen=MAX_SEQLEN, capacity=CAPACITY, seed=s) for s in (1, 2))]
    return docs, [packed_batch(d, T, capacity=CAPACITY, max_seqlen=MAX_SEQLEN).to("cuda") for d in docs]


def _step(model, batch, autocast=True):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = hf.packed_forward(model, batch, compute_loss=True)
    out.loss.backward()
    return out.logits[0].float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def _worst_grad(got, want):
    assert set(got) == set(want)
    return max(((got[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in want.items())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_packed_eager_equals_each_document_alone(name, report):
    family = FAMILIES[name]
    model = tiny_model(name).cuda().train()
    alone = tiny_model(
        name, "eager", state_dict=model.state_dict(), experts_implementation="eager" if family.moe else None
    )
    docs, batches = _batches()
    want_logits, want_grads = per_document_reference(alone.cuda().train(), [d.cuda() for d in docs[0]])
    want_logits = torch.cat(want_logits)
    precision = "fp32" if family.moe else "bf16"
    logits, grads = _step(model, batches[0], autocast=precision == "bf16")
    logit_diff = _rel(logits[: want_logits.shape[0]], want_logits)
    grad_diff = _worst_grad(grads, want_grads)
    report(f"hf {name} packed eager ({precision}) vs alone (fp32): rel logits, worst rel grad",
           f"{logit_diff:.2e}, {grad_diff:.2e}")  # fmt: skip
    assert logit_diff <= ALONE_TOL[precision]["logits"]
    assert grad_diff <= ALONE_TOL[precision]["grads"]


def _cases():
    cases = []
    for name, family in FAMILIES.items():
        for experts in ("grouped_mm", "grouped_mm-bf16-weights", "batched_mm", "eager") if family.moe else (None,):
            cases += [pytest.param(name, experts, scope, id=f"{name}-{experts}-{scope}") for scope in hf.SCOPES]
    return cases


@pytest.mark.parametrize("name,experts,scope", _cases())
def test_graphed_scope_equals_packed_eager(name, experts, scope, report):
    impl = experts.split("-")[0] if experts else None
    dtype = torch.bfloat16 if experts and experts.endswith("bf16-weights") else torch.float32
    model = tiny_model(name, experts_implementation=impl).to("cuda", dtype).train()
    graphed = tiny_model(name, state_dict=model.state_dict(), experts_implementation=impl).to("cuda", dtype).train()
    _, batches = _batches()
    label = f"hf {name}" + (f" experts={experts}" if experts else "") + f" scope={scope}"
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            handle = hf.graph_decoder_layers(graphed, batches[0], scope=scope)
    except GraphCaptureError as exc:
        report(f"{label}: refused", str(exc).splitlines()[0])
        assert impl in ("eager", "grouped_mm") and scope != "attn", str(exc)
        assert f"experts_implementation={impl!r}" in str(exc)  # the MoE hint
        return
    assert not (impl == "eager" and scope != "attn"), "the eager experts loop reads the host: it cannot capture"
    worst, captures = 0.0, []
    for batch in batches:  # the first replays what was captured, the others other offsets of the same bucket
        want_logits, want_grads = _step(model, batch)
        logits, grads = _step(graphed, batch)
        worst = max(worst, _rel(logits, want_logits), _worst_grad(grads, want_grads))
        captures.append([g.captures for g in handle.graphed])
    report(f"{label}: captured; graphed vs packed eager, worst rel diff (logits, grads)", f"{worst:.2e}")
    assert worst <= GRAPHED_TOL
    # One bucket: one capture per layer, at graph_decoder_layers, and none after it (partial scopes under autocast
    # included: capture_layers samples each layer with the input dtype a real call brings).
    assert captures[0] == captures[-1] == [1] * len(captures[0])
    handle.remove()


# ---------------------------------------------------------------------------------------------------- Trainer
TRAIN_STEPS, TRAIN_T = 30, 2048
TRAIN_TOL = 1e-4  # relative, per step, as tests/cuda/test_hf_trainer_cuda.py: same kernels, deterministic


@pytest.mark.parametrize(
    "name,experts,scope",
    [("gemma3", None, "layer"), ("qwen3_moe", "batched_mm", "layer"), ("qwen3_moe", "grouped_mm", "attn")],
)
def test_packgraph_trainer_30_steps_graphed_equals_packed_eager(name, experts, scope, tmp_path, report):
    """``PackgraphTrainer`` (bf16=True) trains a Gemma 3 config (alternating windows of 64 tokens) and a Qwen3-MoE
    config (whole layers with ``batched_mm`` experts; attention only with transformers' default ``grouped_mm``) on
    the corpus under graphs, with per-step losses equal to packed eager's under deterministic kernels."""
    from packgraph.buckets import default_buckets
    from packgraph.data.corpus import PAD_ID, VOCAB_SIZE, load_corpus
    from packgraph.data.stream import split_documents
    from packgraph.integrations.hf_families import size_overrides
    from packgraph.integrations.hf_trainer import PackgraphTrainer, pack_dataset
    from packgraph.train import deterministic_kernels

    policy = default_buckets(TRAIN_T)
    docs = split_documents(load_corpus(max_docs=200), 512, min_len=8, seed=0)
    rows = pack_dataset([{"input_ids": d.tolist()} for d in docs], TRAIN_T, buckets=policy)
    assert len(rows) >= TRAIN_STEPS
    config = dict(
        size_overrides(name, hidden_size=256, num_layers=4, window=64, max_positions=TRAIN_T),
        vocab_size=VOCAB_SIZE, pad_token_id=PAD_ID, initializer_range=0.02,
    )  # fmt: skip
    init = tiny_model(name, experts_implementation=experts, **config).state_dict()
    losses = {}
    with deterministic_kernels(True):
        for graphs in (False, True):
            args = transformers.TrainingArguments(
                output_dir=str(tmp_path / str(graphs)), per_device_train_batch_size=1, max_steps=TRAIN_STEPS,
                learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                max_grad_norm=1.0, bf16=True, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
                seed=0, dataloader_num_workers=0,
            )  # fmt: skip
            model = tiny_model(name, state_dict=init, experts_implementation=experts, **config).cuda()
            trainer = PackgraphTrainer(
                model=model, args=args, train_dataset=rows, total_tokens=TRAIN_T, buckets=policy, graphs=graphs,
                scope=scope,
            )  # fmt: skip
            trainer.train()
            losses[graphs] = torch.tensor([log["loss"] for log in trainer.state.log_history if "loss" in log])
            if graphs:
                layers = trainer.packgraph_layers
                assert layers is not None and layers.scope == scope
                report(f"hf Trainer {name} experts={experts} scope={scope}: graphs per layer",
                       layers.graphed[0].num_graphs)  # fmt: skip
    eager, graphed = losses[False], losses[True]
    assert len(eager) == len(graphed) == TRAIN_STEPS
    rel = ((graphed - eager).abs() / eager.abs()).max().item()
    report(f"hf Trainer {name} experts={experts} scope={scope}: {TRAIN_STEPS} steps, max rel loss diff, "
           "bitwise-equal steps, first/last loss",
           f"{rel:.2e}, {int((graphed == eager).sum())}/{TRAIN_STEPS}, {eager[0]:.3f}/{eager[-1]:.3f}")  # fmt: skip
    assert rel <= TRAIN_TOL
    assert eager[-1] < eager[0]  # it trains
