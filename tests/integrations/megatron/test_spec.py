"""The packgraph Megatron spec against the real Megatron-Core, on the CPU.

The reference is Megatron's own stock path: a ``GPTModel`` built with ``get_gpt_layer_local_spec`` (Megatron's
``DotProductAttention``, causal mask, bshd), with the same weights, run on each document alone. A packed THD batch
through the packgraph spec must give each document's logits, and the sum of their parameter grads, to fp32 rounding.
"""

import functools
import random

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402

from packgraph.integrations.megatron import (  # noqa: E402
    PackgraphDotProductAttention,
    PackgraphSelfAttention,
    get_gpt_layer_packgraph_spec,
    to_megatron,
)
from packgraph.packing import PackedBatch  # noqa: E402
from tests.megatron_shims import (  # noqa: E402
    PAD_ID,
    VOCAB,
    gpt_model,
    megatron_on_cpu,
    packed_logits,
    packed_loss,
    tiny_config,
)

REL_TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _megatron_cpu():
    with megatron_on_cpu():
        yield


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


def _pair(config, position_embedding_type, **model_kwargs):
    kwargs = dict(position_embedding_type=position_embedding_type, **model_kwargs)
    stock = gpt_model(get_gpt_layer_local_spec(), config, **kwargs)
    ours = gpt_model(get_gpt_layer_packgraph_spec(), config, seed=1, **kwargs)
    ours.load_state_dict(stock.state_dict(), strict=True)  # same parameter names: weights load both ways
    return stock, ours


def _docs(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (n,), generator=gen) for n in lengths]


def _per_document_reference(stock, docs):
    """Each document alone through the stock local spec: its logits, and the grads of the summed losses."""
    stock.zero_grad(set_to_none=True)
    logits = []
    for doc in docs:
        out = stock(doc[None], torch.arange(len(doc))[None], None)[0]
        targets = torch.cat([doc[1:], doc.new_full((1,), -100)])
        torch.nn.functional.cross_entropy(out, targets, ignore_index=-100, reduction="sum").backward()
        logits.append(out.detach())
    return logits, {name: p.grad.clone() for name, p in stock.named_parameters()}


CASES = {
    "rope-gqa-tail": dict(pos="rope", groups=2, pad=1, lengths=[7, 1, 12, 5], T=40, capacity=6),
    "rope-mha-padded": dict(pos="rope", groups=4, pad=4, lengths=[6, 9, 3], T=32, capacity=4),
    "rope-mqa-padded-tail": dict(pos="rope", groups=1, pad=8, lengths=[5, 11, 2, 8], T=64, capacity=8),
    "rope-partial-interleaved-padded": dict(
        pos="rope", groups=2, pad=4, lengths=[9, 2, 7], T=40, capacity=4, rotary_percent=0.5, interleaved=True
    ),
    "learned-absolute-gqa-tail": dict(pos="learned_absolute", groups=2, pad=1, lengths=[10, 4, 13], T=36, capacity=4),
    "learned-absolute-padded": dict(pos="learned_absolute", groups=4, pad=4, lengths=[3, 14, 6], T=32, capacity=3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_thd_equals_each_document_through_the_stock_spec(case):
    c = CASES[case]
    config = tiny_config(num_query_groups=c["groups"], rotary_interleaved=c.get("interleaved", False))
    stock, ours = _pair(config, c["pos"], rotary_percent=c.get("rotary_percent", 1.0))
    docs = _docs(c["lengths"], seed=len(case))
    batch = PackedBatch.from_documents(
        docs,
        bin_size=c["T"],
        capacity=c["capacity"],
        max_seqlen=max(c["lengths"]),
        pad_to_multiple=c["pad"],
        pad_id=PAD_ID,
    )
    ref_logits, ref_grads = _per_document_reference(stock, docs)

    ours.zero_grad(set_to_none=True)
    logits = packed_logits(ours, batch)
    packed_loss(logits, batch).backward()

    layout = batch.packed_seq_params.layout_offsets("q").tolist()
    for i, (doc, ref) in enumerate(zip(docs, ref_logits, strict=True)):
        rows = logits[layout[i] : layout[i] + len(doc)].detach()
        assert _rel(rows, ref) <= REL_TOL, (case, "logits of document", i)
    for name, p in ours.named_parameters():
        assert _rel(p.grad, ref_grads[name]) <= REL_TOL, (case, name)


def test_dead_rows_come_out_zero_and_do_not_reach_live_rows():
    """Core attention zeroes padding and tail rows; what sits on dead rows never changes a live row's logits."""
    _, ours = _pair(tiny_config(), "rope")
    docs = _docs([5, 9, 3], seed=3)
    batch = PackedBatch.from_documents(docs, bin_size=40, capacity=5, max_seqlen=16, pad_to_multiple=4, pad_id=PAD_ID)
    captured = []
    core = ours.decoder.layers[0].self_attention.core_attention
    hook = core.register_forward_hook(lambda mod, args, out: captured.append(out.detach()))
    logits = packed_logits(ours, batch).detach()
    hook.remove()
    rows = torch.arange(batch.total_tokens)
    layout = batch.packed_seq_params.layout_offsets("q")
    live = torch.zeros(batch.total_tokens, dtype=torch.bool)
    for start, n in zip(layout.tolist(), batch.doc_lengths, strict=False):
        live |= (rows >= start) & (rows < start + n)
    assert captured[0].shape == (batch.total_tokens, 32)
    assert torch.equal(captured[0][~live], torch.zeros_like(captured[0][~live]))
    assert captured[0][live].abs().amin(dim=-1).gt(0).all()

    scrambled = batch.tokens.clone()
    scrambled[~live] = torch.randint(0, VOCAB, (int((~live).sum()),))
    other = PackedBatch(
        tokens=scrambled,
        labels=batch.labels,
        loss_mask=batch.loss_mask,
        position_ids=batch.position_ids,
        packed_seq_params=batch.packed_seq_params,
    )
    assert torch.equal(packed_logits(ours, other).detach()[live], logits[live])


def test_without_packed_params_it_is_megatrons_causal_attention():
    stock, ours = _pair(tiny_config(), "rope")
    tokens = torch.randint(0, VOCAB, (2, 11))
    positions = torch.arange(11)[None].expand(2, -1)
    assert torch.equal(ours(tokens, positions, None), stock(tokens, positions, None))


def test_megatron_packed_params_and_packgraph_params_give_the_same_logits():
    _, ours = _pair(tiny_config(), "rope")
    batch = PackedBatch.from_documents(_docs([6, 8], seed=5), bin_size=20, capacity=3, max_seqlen=8, pad_id=PAD_ID)
    params = batch.packed_seq_params.attention_view()
    theirs = packed_logits(ours, batch, to_megatron(params))
    assert torch.equal(packed_logits(ours, batch, params), theirs)


def test_spec_is_the_local_spec_with_two_modules_swapped():
    ours, stock = get_gpt_layer_packgraph_spec(qk_layernorm=True), get_gpt_layer_local_spec(qk_layernorm=True)
    attention = ours.submodules.self_attention
    assert attention.module is PackgraphSelfAttention
    assert attention.submodules.core_attention is PackgraphDotProductAttention
    assert attention.params == stock.submodules.self_attention.params == {"attn_mask_type": AttnMaskType.causal}
    assert attention.submodules.linear_qkv is stock.submodules.self_attention.submodules.linear_qkv
    assert attention.submodules.q_layernorm is stock.submodules.self_attention.submodules.q_layernorm
    assert _builder(ours.submodules.mlp) == _builder(stock.submodules.mlp)
    with pytest.raises(TypeError, match="does not take"):
        get_gpt_layer_packgraph_spec(no_such_option=True)


def _builder(spec):
    """A comparable form of a submodule spec: a ModuleSpec, or (Megatron >= 0.17) a functools.partial."""
    if isinstance(spec, functools.partial):
        return spec.func, spec.args, spec.keywords
    return spec


# ---------------------------------------------------------------------------------------------------- refusals
def _core_attention(config):
    return PackgraphDotProductAttention(
        config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )


def test_refuses_mla():
    with pytest.raises(NotImplementedError, match="multi-latent"):
        get_gpt_layer_packgraph_spec(multi_latent_attention=True)
    config = tiny_config()
    config.multi_latent_attention = True
    with pytest.raises(NotImplementedError, match="multi-latent"):
        PackgraphSelfAttention(config, get_gpt_layer_packgraph_spec().submodules.self_attention.submodules, 1)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
def test_refuses_softmax_types_other_than_vanilla(softmax_type):
    config = tiny_config()
    config.softmax_type = softmax_type
    with pytest.raises(NotImplementedError, match=f"softmax_type='{softmax_type}'"):
        _core_attention(config)


def test_refuses_context_parallel():
    config = tiny_config()
    config.context_parallel_size = 2
    with pytest.raises(NotImplementedError, match="context_parallel_size=2.*cp_varlen_attention"):
        _core_attention(config)


def test_refuses_what_a_thd_call_cannot_honour():
    batch = PackedBatch.from_documents(_docs([6, 8], seed=7), bin_size=16, capacity=2, max_seqlen=8, pad_id=PAD_ID)
    params = to_megatron(batch.packed_seq_params.attention_view())
    q = torch.randn(16, 4, 8)
    kv = torch.randn(16, 2, 8)
    core = _core_attention(tiny_config())
    with pytest.raises(ValueError, match="attention_mask=None"):
        core(q, kv, kv, torch.ones(1, 1, 16, 16, dtype=torch.bool), packed_seq_params=params)
    with pytest.raises(NotImplementedError, match="attention_bias"):
        core(q, kv, kv, None, attention_bias=torch.zeros(1), packed_seq_params=params)
    with pytest.raises(NotImplementedError, match="attn_mask_type"):
        core(q, kv, kv, None, attn_mask_type=AttnMaskType.padding, packed_seq_params=params)
    dropout = _core_attention(tiny_config(attention_dropout=0.1))
    with pytest.raises(NotImplementedError, match="attention_dropout=0.1"):
        dropout.train()(q, kv, kv, None, packed_seq_params=params)
    reference = core(q, kv, kv, None, packed_seq_params=params)
    assert torch.equal(dropout.eval()(q, kv, kv, None, packed_seq_params=params), reference)  # eval: no dropout
    no_mask = core(q, kv, kv, None, attn_mask_type=AttnMaskType.no_mask, packed_seq_params=params)[:6]
    assert _rel(no_mask, _full_attention_reference(q[:6], kv[:6], kv[:6])) <= REL_TOL


def _full_attention_reference(q, k, v):
    """Non-causal attention of one sequence, heads grouped as GQA, in float64: ``[n, heads * head_dim]``."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).double(), v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / q.shape[-1] ** 0.5
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out.reshape(q.shape[0], -1).float()


# ---------------------------------------------------------------------------------------------------- host syncs
class _HostReads(torch.overrides.TorchFunctionMode):
    """Records every tensor op that reads device values on the host (what a CUDA graph capture cannot contain)."""

    READS = {
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__index__,
        torch.Tensor.__float__,
        torch.Tensor.nonzero,
        torch.nonzero,
        torch.Tensor.numpy,
        torch.Tensor.cpu,
    }

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            import traceback

            frame = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename][-1]
            self.seen.append((func.__name__, frame.filename, frame.lineno))
        return func(*args, **(kwargs or {}))


def test_packed_forward_backward_reads_nothing_on_the_host():
    """The CPU image of find_host_syncs: no op of the packgraph-spec forward+backward reads a tensor on the host,
    while Megatron's own THD RoPE does (the check can fail)."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rope_utils

    _, ours = _pair(tiny_config(), "rope")
    batch = PackedBatch.from_documents(_docs([5, 9, 3], seed=9), bin_size=24, capacity=5, max_seqlen=16, pad_id=PAD_ID)
    params = to_megatron(batch.packed_seq_params.attention_view())
    with _HostReads() as reads:
        packed_loss(packed_logits(ours, batch, params), batch).backward()
    assert reads.seen == []

    with _HostReads() as reads:
        rope_utils._apply_rotary_pos_emb_thd(
            torch.randn(17, 4, 8),
            params.cu_seqlens_q[:4],
            torch.randn(16, 1, 1, 8),
            cp_group=parallel_state.get_context_parallel_group(),
        )
    assert any(name == "tolist" and filename.endswith("rope_utils.py") for name, filename, _ in reads.seen)


def test_rope_positions_restart_at_each_padded_document_start():
    """Shifting a document to another padded slot leaves its logits unchanged (positions are per document)."""
    _, ours = _pair(tiny_config(), "rope")
    rng = random.Random(0)
    doc = _docs([9], seed=11)[0]
    filler = _docs([rng.randint(1, 12) for _ in range(3)], seed=12)
    alone = PackedBatch.from_documents([doc], bin_size=16, capacity=1, max_seqlen=16, pad_id=PAD_ID)
    batch = PackedBatch.from_documents(
        [*filler, doc], bin_size=64, capacity=4, max_seqlen=16, pad_to_multiple=8, pad_id=PAD_ID
    )
    start = batch.packed_seq_params.layout_offsets("q").tolist()[3]
    shifted = packed_logits(ours, batch).detach()[start : start + 9]
    assert _rel(shifted, packed_logits(ours, alone).detach()[:9]) <= REL_TOL
