"""The model families of issue #32 through ``attn_implementation="packgraph"``, packed and eager, on the CPU.

Each family (``packgraph.integrations.hf_families``: Llama, Qwen2 with its sliding window, Qwen3, Qwen3-MoE, Mistral
v0.1, Mixtral, Gemma 2, Gemma 3, Phi-3, OLMo 2, GPT-NeoX, Starcoder2, gpt-oss) is a tiny random model whose windows
are shorter than most documents. The reference is independent of packgraph: each document run alone through the
same weights with transformers' own ``"eager"`` attention (and, for MoE, its ``"eager"`` experts loop), whose masks
transformers builds for each layer type. Graphed layers are checked in test_hf_families_graphs.py.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from packgraph.integrations import hf  # noqa: E402
from packgraph.integrations.hf_families import (  # noqa: E402
    FAMILIES,
    WINDOW,
    documents,
    packed_batch,
    per_document_reference,
    tiny_model,
)
from packgraph.params import PackedSeqParams  # noqa: E402

# float32 throughout. transformers' eager attention takes its softmax in float32 over whole documents, packgraph's over
# the packed stream; the sums run in another order, which moves logits by ~2e-6 and grads by ~3e-7 here.
LOGITS_TOL = dict(atol=1e-5, rtol=1e-5)
GRADS_TOL = dict(atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_packed_logits_and_grads_equal_each_document_alone(name):
    family = FAMILIES[name]
    model = tiny_model(name).train()
    experts = "eager" if family.moe else None  # the reference runs transformers' plain loop over the experts
    ref = tiny_model(name, "eager", state_dict=model.state_dict(), experts_implementation=experts).train()
    docs = documents()
    out = hf.packed_forward(model, packed_batch(docs), compute_loss=True)
    out.loss.backward()
    want_logits, want_grads = per_document_reference(ref, docs)
    start = 0
    for k, (doc, want) in enumerate(zip(docs, want_logits, strict=True)):
        torch.testing.assert_close(out.logits[0, start : start + len(doc)], want, **LOGITS_TOL, msg=f"document {k}")
        start += len(doc)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(want_grads)
    for n, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[n], **GRADS_TOL, msg=n)


def _alone_logits(model, docs):
    with torch.no_grad():
        return torch.cat([model(input_ids=d.view(1, -1), use_cache=False).logits[0] for d in docs])


_WITH_FEATURES = [n for n, f in FAMILIES.items() if f.windowed or {"softcap", "sinks"} & set(f.features)]


@pytest.mark.parametrize("name", _WITH_FEATURES)
def test_every_feature_moves_the_reference(name):
    """Each window, softcap and sink bends these tiny models' logits by far more than the tolerances above, so a
    feature the packed path dropped or got wrong by one token would fail the test above."""
    family = FAMILIES[name]
    model = tiny_model(name, "eager")
    docs = documents()
    base = _alone_logits(model, docs)
    changed = []
    if family.windowed:
        changed.append(tiny_model(name, "eager", state_dict=model.state_dict(), sliding_window=1000))
        for shift in (-1, 1):  # one token more or less of window
            changed.append(tiny_model(name, "eager", state_dict=model.state_dict(), sliding_window=WINDOW + shift))
    if "softcap" in family.features:
        changed.append(tiny_model(name, "eager", state_dict=model.state_dict(), attn_logit_softcapping=None))
    if "sinks" in family.features:
        no_sinks = tiny_model(name, "eager", state_dict=model.state_dict())
        with torch.no_grad():
            for layer in no_sinks.model.layers:
                layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4) = 0: no sink
        changed.append(no_sinks)
    for other in changed:
        assert (_alone_logits(other, docs) - base).abs().max() > 0.05


# ---------------------------------------------------------------------------------------------------- windows
def _params(max_seqlen):
    return PackedSeqParams.from_seqlens([3, max_seqlen], max_seqlen=max_seqlen)


def test_attention_window_follows_transformers():
    """HF's sliding_window=W: a query sees itself and W - 1 tokens back (masking_utils: kv_idx > q_idx - W);
    FlashAttention's window counts the tokens on each side, itself excluded."""
    assert hf.attention_window(None, _params(20)) is None
    assert hf.attention_window(8, _params(20)) == (7, 0)
    assert hf.attention_window(8, _params(20), causal=False) == (7, 7)  # transformers' flash path, symmetric
    assert hf.attention_window(1, _params(20)) == (0, 0)  # itself only
    # No document longer than the window (the bucket's static max_seqlen says so): no window at all.
    assert hf.attention_window(8, _params(8)) is None
    assert hf.attention_window(8, _params(9)) == (7, 0)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        hf.attention_window(0, _params(20))


def _spy_attention(monkeypatch):
    calls = []

    def recording(q, k, v, params, **kwargs):
        calls.append(kwargs)
        return torch.zeros_like(q)

    monkeypatch.setattr(hf, "varlen_attention", recording)
    return calls


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_layer_gets_its_own_window_softcap_and_sinks(name, monkeypatch):
    """What reaches varlen_attention, layer by layer: the window of the layer's type (local layers of Gemma 2/3 and
    gpt-oss, Qwen2's layers from max_window_layers on, every layer of Mistral/Mixtral/Phi-3/Starcoder2), none on
    a global layer or when no document exceeds the window; Gemma 2's softcap; gpt-oss's sinks, the parameter itself."""
    family = FAMILIES[name]
    model = tiny_model(name)
    config = model.config
    calls = _spy_attention(monkeypatch)
    with torch.no_grad():
        hf.packed_forward(model, packed_batch(documents()))
        n = len(calls)
        hf.packed_forward(model, packed_batch(documents((WINDOW, 3, 5)), 20))  # nothing longer than the window
    assert n == config.num_hidden_layers and len(calls) == 2 * n
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * n
    for i, (long_docs, short_docs) in enumerate(zip(calls[:n], calls[n:], strict=True)):
        if "window" in family.features or ("alternating" in family.features and layer_types[i] == "sliding_attention"):
            assert long_docs.get("window") == (WINDOW - 1, 0), f"layer {i}"
        else:
            assert "window" not in long_docs, f"layer {i}"
        assert "window" not in short_docs, f"layer {i}"
        for kwargs in (long_docs, short_docs):
            if "softcap" in family.features:
                assert kwargs["softcap"] == config.attn_logit_softcapping
            else:
                assert "softcap" not in kwargs
            if "sinks" in family.features:
                assert kwargs["sinks"] is model.model.layers[i].self_attn.sinks
            else:
                assert "sinks" not in kwargs
            assert kwargs["causal"] is True
    if family.windowed:
        assert any("window" in c for c in calls[:n])  # the family's config really has local layers
    if "alternating" in family.features:
        assert any("window" not in c for c in calls[:n])  # and global ones
