"""Hugging Face integration on the CPU: the "packgraph" attention and the graphed-layer plumbing (the batch
conversions have their own tests in test_hf_batches.py).

References are independent of the code under test: each document run alone through the same weights with
transformers' own "eager" attention, HF's own loss on the collator output, and label/position layouts written
out by hand.
"""

import copy
import warnings
from itertools import pairwise

import pytest
import torch

transformers = pytest.importorskip("transformers")

from packgraph.graphs import use_recorder  # noqa: E402
from packgraph.integrations import hf  # noqa: E402
from packgraph.params import PackedSeqParamsError  # noqa: E402
from tests.eager_recorder import EagerRecorder  # noqa: E402
from tests.integrations.hf_docs import DOC_LENGTHS, TOTAL_TOKENS, VOCAB  # noqa: E402
from tests.integrations.hf_docs import collate as _collate  # noqa: E402
from tests.integrations.hf_docs import docs as _docs  # noqa: E402


def _configs():
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: kv heads are not repeated by the packgraph attention
        max_position_embeddings=128,
    )
    return {
        "llama": transformers.LlamaConfig(**common),
        "qwen3": transformers.Qwen3Config(**common, head_dim=8),
        "qwen2": transformers.Qwen2Config(**common),
        "mistral": transformers.MistralConfig(**common, sliding_window=None),
    }


def _model(config, attn_implementation, state_dict=None):
    # from_config writes the implementation into the config it is given: each model needs its own copy.
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=attn_implementation
    )
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.eval()


def _per_doc_reference(model, docs):
    with torch.no_grad():
        return [model(input_ids=d.view(1, -1), use_cache=False).logits[0] for d in docs]


@pytest.fixture(scope="module")
def llama_pair():
    config = _configs()["llama"]
    packed = _model(config, "packgraph")
    eager = _model(config, "eager", packed.state_dict())
    return packed, eager


# ---------------------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen2", "mistral"])
def test_packed_logits_equal_each_document_alone(name):
    config = _configs()[name]
    packed_model = _model(config, "packgraph")
    eager_model = _model(config, "eager", packed_model.state_dict())
    assert packed_model.config._attn_implementation == "packgraph"
    assert eager_model.config._attn_implementation == "eager"
    docs = _docs()
    batch = hf.from_flattening_batch(_collate(docs), total_tokens=TOTAL_TOKENS)
    with torch.no_grad():
        logits = hf.packed_forward(packed_model, batch).logits[0]
    assert logits.shape == (TOTAL_TOKENS, VOCAB)
    start = 0
    for doc, ref in zip(docs, _per_doc_reference(eager_model, docs), strict=True):
        torch.testing.assert_close(logits[start : start + len(doc)], ref, atol=1e-5, rtol=1e-5)
        start += len(doc)


def test_no_cross_document_leakage(llama_pair):
    model, _ = llama_pair
    docs = _docs()
    perturbed = [d.clone() for d in docs]
    perturbed[1] = (perturbed[1] + 1 + torch.arange(len(perturbed[1]))) % VOCAB  # every token of doc 1 changes
    with torch.no_grad():
        base = hf.packed_forward(model, hf.from_flattening_batch(_collate(docs), total_tokens=TOTAL_TOKENS)).logits[0]
        moved = hf.packed_forward(model, hf.from_flattening_batch(_collate(perturbed), total_tokens=TOTAL_TOKENS))
    moved = moved.logits[0]
    starts = [0, *torch.tensor(DOC_LENGTHS).cumsum(0).tolist()]
    for i, (a, b) in enumerate(pairwise(starts)):
        if i == 1:
            assert (base[a:b] - moved[a:b]).abs().max() > 1e-3  # the perturbation is visible where it belongs
        else:
            torch.testing.assert_close(moved[a:b], base[a:b], atol=1e-6, rtol=0)


def test_hf_flash_kwargs_path_and_loss_convention(llama_pair):
    """The collator output fed straight to the model (HF shifts labels in its loss) scores the same tokens as
    the PackedBatch's pre-shifted labels."""
    model, _ = llama_pair
    collated = _collate(_docs(), return_flash_attn_kwargs=True)
    batch = hf.from_flattening_batch(collated, total_tokens=TOTAL_TOKENS)
    with torch.no_grad():
        hf_out = model(**collated, use_cache=False)
        ours = hf.packed_forward(model, batch, compute_loss=True)
    n = collated["input_ids"].shape[1]
    torch.testing.assert_close(ours.logits[0, :n], hf_out.logits[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.loss, hf_out.loss, atol=1e-6, rtol=1e-6)


def test_attention_errors(llama_pair):
    model, _ = llama_pair
    collated = _collate(_docs(), return_flash_attn_kwargs=True)
    ids, pos = collated["input_ids"], collated["position_ids"]
    cu = collated["cu_seq_lens_q"]
    with pytest.raises(PackedSeqParamsError, match="from_flattening_batch"):
        model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=torch.tensor(17),
              max_length_k=torch.tensor(17), use_cache=False)  # fmt: skip
    with pytest.raises(PackedSeqParamsError, match="no packing metadata"):
        model(input_ids=ids, position_ids=pos, use_cache=False)
    with pytest.raises(ValueError, match="batch size 1"):
        model(input_ids=ids.expand(2, -1), cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=17, max_length_k=17,
              use_cache=False)  # fmt: skip
    config = transformers.LlamaConfig(**{**_configs()["llama"].to_dict(), "attention_dropout": 0.1})
    dropout = _model(config, "packgraph")
    with pytest.raises(NotImplementedError, match="no attention dropout"):
        hf.packed_forward(dropout.train(), hf.from_flattening_batch(collated))
    hf.packed_forward(dropout.eval(), hf.from_flattening_batch(collated))  # eval: no dropout, nothing refused


def test_register_is_idempotent():
    from transformers import AttentionInterface

    assert hf.register_packgraph_attention() == "packgraph"
    assert hf.register_packgraph_attention() == "packgraph"
    assert AttentionInterface._global_mapping["packgraph"] is hf.packgraph_attention


def test_batch_conversions_are_reexported():
    from packgraph.integrations import hf_batches

    for name in hf_batches.__all__:
        assert name in hf.__all__ and getattr(hf, name) is getattr(hf_batches, name), name


# ---------------------------------------------------------------------------------------------------- graphs
def test_graph_decoder_layers_needs_cuda(llama_pair):
    """Without a stand-in recorder the engine records CUDA graphs: a CPU model cannot be captured."""
    model, _ = llama_pair
    sample = hf.from_flattening_batch(_collate(_docs()), total_tokens=TOTAL_TOKENS)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="graph inputs must be on cuda"):
            hf.graph_decoder_layers(model, sample)
    else:
        with pytest.raises(RuntimeError, match="CUDA"):
            hf.graph_decoder_layers(model, sample)
    assert not any("forward" in layer.__dict__ for layer in model.model.layers)


@pytest.mark.parametrize("scope", ["layer", "attn", "mlp"])
def test_graph_plumbing_matches_eager(scope):
    """The patched forwards (split into graph inputs, call, restore HF's structure) change nothing: with an
    identity 'capture' that returns the adapters themselves, logits and grads equal the unpatched model's."""
    config = _configs()["llama"]
    model = _model(config, "packgraph").train()
    ref = _model(config, "packgraph", model.state_dict()).train()
    batch = hf.from_flattening_batch(_collate(_docs()), total_tokens=TOTAL_TOKENS)
    seen = []

    def identity_capture(adapters, sample_args, recompute):
        seen.append(sample_args)
        assert not recompute  # gradient checkpointing is off
        return adapters

    handle = hf._install(model, batch, scope=scope, forward_only=False, make_graphed=identity_capture)
    n_args = 1 if scope == "mlp" else 4
    assert len(seen[0]) == n_args and seen[0][0].requires_grad
    assert all("forward" in t.__dict__ for t in handle.targets)
    out = hf.packed_forward(model, batch, compute_loss=True)
    expected = hf.packed_forward(ref, batch, compute_loss=True)
    out.loss.backward()
    expected.loss.backward()
    torch.testing.assert_close(out.logits, expected.logits, atol=0, rtol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=0, msg=name)
    handle.remove()
    assert not any("forward" in t.__dict__ for t in handle.targets)
    with pytest.raises(ValueError, match="no attention mask"):
        with hf._install(model, batch, scope="layer", forward_only=False, make_graphed=identity_capture):
            model.model.layers[0](out.logits.new_zeros(1, 4, 32), attention_mask=torch.ones(1, 1, 4, 4),
                                  position_embeddings=(None, None))  # fmt: skip
    assert not any("forward" in layer.__dict__ for layer in model.model.layers)


def test_graph_plumbing_rejects_wrong_attention():
    model = _model(_configs()["llama"], "eager")
    batch = hf.from_flattening_batch(_collate(_docs()), total_tokens=TOTAL_TOKENS)
    with pytest.raises(ValueError, match="attn_implementation='packgraph'"):
        hf._install(model, batch, scope="layer", forward_only=False, make_graphed=lambda a, s: a)


def _same_signature_batches():
    return [
        hf.from_flattening_batch(_collate(_docs(lengths, seed)), total_tokens=TOTAL_TOKENS, capacity=8, max_seqlen=32)
        for lengths, seed in ((DOC_LENGTHS, 0), ((30, 2, 7), 1), ((1, 1, 20, 3, 3, 3, 2, 6), 2))
    ]


@pytest.mark.parametrize("scope", ["layer", "attn", "mlp"])
def test_graph_decoder_layers_through_the_engine_on_a_cpu_stand_in(scope):
    config = _configs()["llama"]
    model = _model(config, "packgraph").train()
    ref = _model(config, "packgraph", model.state_dict()).train()
    batches = _same_signature_batches()
    with use_recorder(EagerRecorder()):
        handle = hf.graph_decoder_layers(model, batches[0], scope=scope)
    for batch in batches:
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        out = hf.packed_forward(model, batch, compute_loss=True)
        expected = hf.packed_forward(ref, batch, compute_loss=True)
        out.loss.backward()
        expected.loss.backward()
        torch.testing.assert_close(out.logits, expected.logits, atol=1e-6, rtol=1e-6)
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)
    assert [g.captures for g in handle.graphed] == [1] * config.num_hidden_layers  # one signature, no recapture
    # Paused: the original forwards run (a new shape would otherwise need graphs of its own), the graphs stay.
    odd = hf.from_flattening_batch(_collate(_docs((3, 4))), total_tokens=7)
    replays = [_replays(g) for g in handle.graphed]
    with torch.no_grad(), handle.paused():
        assert not any("forward" in t.__dict__ for t in handle.targets)
        got = hf.packed_forward(model, odd).logits
        torch.testing.assert_close(got, hf.packed_forward(ref, odd).logits, atol=1e-6, rtol=1e-6)
    assert [_replays(g) for g in handle.graphed] == replays and all("forward" in t.__dict__ for t in handle.targets)
    assert [g.captures for g in handle.graphed] == [1] * config.num_hidden_layers
    handle.remove()
    assert not any("forward" in t.__dict__ for t in handle.targets)


def _scope_warnings(caught):
    return [w for w in caught if issubclass(w.category, FutureWarning) and "scope=" in str(w.message)]


def test_attention_scope_is_a_deprecated_alias_of_attn():
    """scope="attention" (the old name) still graphs each layer's self_attn, with one FutureWarning that names
    "attn" and points at the caller; "attn" itself warns nothing."""
    config = _configs()["llama"]
    model = _model(config, "packgraph").train()
    ref = _model(config, "packgraph", model.state_dict()).train()
    batch = _same_signature_batches()[0]
    with use_recorder(EagerRecorder()), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = hf.graph_decoder_layers(model, batch, scope="attention")
        out = hf.packed_forward(model, batch, compute_loss=True)
    (warning,) = _scope_warnings(caught)
    assert "'attn'" in str(warning.message) and warning.filename == __file__
    assert handle.scope == "attn"
    assert all(t is layer.self_attn for t, layer in zip(handle.targets, model.model.layers, strict=True))
    expected = hf.packed_forward(ref, batch, compute_loss=True)
    torch.testing.assert_close(out.logits, expected.logits, atol=1e-6, rtol=1e-6)
    handle.remove()
    with use_recorder(EagerRecorder()), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf.graph_decoder_layers(model, batch, scope="attn").remove()
    assert _scope_warnings(caught) == []
    with pytest.raises(ValueError, match="scope must be one of"):
        hf.graph_decoder_layers(model, batch, scope="self_attn")


def _replays(graphed):
    return sum(e.fwd.graph.replays + (e.bwd.graph.replays if e.bwd is not None else 0) for e in graphed.cache.values())


def test_graph_decoder_layers_forward_only_on_a_cpu_stand_in():
    config = _configs()["qwen3"]
    model = _model(config, "packgraph")
    ref = _model(config, "packgraph", model.state_dict())
    batches = _same_signature_batches()
    with use_recorder(EagerRecorder()), torch.no_grad():
        with hf.graph_decoder_layers(model, batches[0], forward_only=True) as handle:
            for batch in batches:
                got = hf.packed_forward(model, batch).logits
                torch.testing.assert_close(got, hf.packed_forward(ref, batch).logits, atol=1e-6, rtol=1e-6)
            # Captured in eval mode and called in eval mode: one graph per layer, no recapture.
            assert [g.captures for g in handle.graphed] == [1] * config.num_hidden_layers


def test_attention_casts_to_the_autocast_dtype(monkeypatch):
    """Under autocast the projections are bf16 but RoPE's float32 tables promote q and k back to float32: the
    attention gets all three in the autocast dtype (SDPA would cast them the same way), and nothing otherwise."""
    seen = []

    def recording_attention(q, k, v, params, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return q

    monkeypatch.setattr(hf, "varlen_attention", recording_attention)
    module = torch.nn.Module()
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    v = torch.randn(1, 2, 6, 8, dtype=torch.bfloat16)
    meta = dict(cu_seq_lens_q=torch.tensor([0, 6], dtype=torch.int32), max_length_q=6, max_length_k=6)
    meta["cu_seq_lens_k"] = meta["cu_seq_lens_q"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = hf.packgraph_attention(module, q, k, v, None, **meta)
    assert seen == [(torch.bfloat16,) * 3] and out.dtype == torch.bfloat16
    hf.packgraph_attention(module, q, k, v.float(), None, **meta)
    assert seen[-1] == (torch.float32,) * 3


@pytest.mark.parametrize("scope", ["layer", "attn"])
def test_graphed_decoder_layers_train_like_eager_over_a_random_schedule(scope):
    """An HF model and its graphed twin, trained with AdamW on one random schedule of packed batches over several
    buckets (captured as they come), with one or two micro-batches and both ``zero_grad`` modes: logits, grads and
    weights stay the reference's at every step."""
    import random

    from packgraph.buckets import default_buckets

    config = _configs()["llama"]
    model = _model(config, "packgraph").train().double()
    ref = _model(config, "packgraph", model.state_dict()).train().double()
    pool = [
        hf.from_flattening_batch(_collate(_docs(lengths, seed)), total_tokens=TOTAL_TOKENS)
        for seed, lengths in enumerate([DOC_LENGTHS, (40,), (1,) * 30, (7, 7, 7), (2,) * 20, (50, 3)])
    ]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    rng = random.Random(3)
    with use_recorder(EagerRecorder()):
        handle = hf.graph_decoder_layers(model, pool[0], scope=scope, buckets=default_buckets(TOTAL_TOKENS))
        for step in range(14):
            micro = [rng.choice(pool) for _ in range(rng.choice([1, 2]))]
            set_to_none = rng.random() < 0.6
            logits = []
            for m, opt in ((ref, opts[0]), (model, opts[1])):
                opt.zero_grad(set_to_none=set_to_none)
                for batch in micro:
                    out = hf.packed_forward(m, batch, compute_loss=True)
                    out.loss.backward()
                    logits.append(out.logits.detach())
            for a, b in zip(logits[: len(micro)], logits[len(micro) :], strict=True):
                torch.testing.assert_close(b, a, atol=1e-9, rtol=1e-9, msg=f"step {step}")
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, atol=1e-9, rtol=1e-8, msg=f"step {step} {name}")
            for opt in opts:
                opt.step()
    assert max(g.num_graphs for g in handle.graphed) >= 2
    handle.remove()


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_the_doc_mask_attention_gives_each_document_alone(name):
    """``attn_implementation="packgraph_doc_mask"``: the packed logits of each document equal that document run alone
    through transformers' eager attention (forward only: torch's FlexAttention has no CPU backward), under one
    bucket of ``document_mask_buckets``; and a sliding-window model keeps its window."""
    from packgraph.buckets import document_mask_buckets

    config = _configs()[name]
    if name == "qwen2":
        config = transformers.Qwen2Config(**{**config.to_dict(), "use_sliding_window": True, "sliding_window": 5,
                                             "max_window_layers": 0})  # fmt: skip
    packed_model = _model(config, "packgraph_doc_mask")
    eager_model = _model(config, "eager", packed_model.state_dict())
    docs = _docs()
    batch = hf.from_flattening_batch(_collate(docs), buckets=document_mask_buckets(TOTAL_TOKENS))
    assert batch.packed_seq_params.max_seqlen_q == TOTAL_TOKENS
    with torch.no_grad():
        logits = hf.packed_forward(packed_model, batch).logits[0]
    start = 0
    for doc, ref in zip(docs, _per_doc_reference(eager_model, docs), strict=True):
        torch.testing.assert_close(logits[start : start + len(doc)], ref, atol=1e-5, rtol=1e-5)
        start += len(doc)
