"""The reference GPT's wiring, against a naive single-document transformer written here in float64.

The naive model reads the packed model's weights but shares none of its code: plain causal softmax attention over
one document at a time, RoPE with positions ``arange(len)``, explicit GQA head repetition. Equality of per-document
logits, loss, logprobs and grads proves packing, RoPE restarts, masking and the tied head are wired right.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from packgraph.graphs import use_recorder
from packgraph.models.gpt import GPT, PRESETS, SCOPES, GPTConfig
from packgraph.packing import PackedBatch
from packgraph.params import PackedSeqParams
from tests.eager_recorder import EagerRecorder


def naive_rope(x, base):
    """x [L, H, D]; rotate-half RoPE with positions 0..L-1."""
    L, _, D = x.shape
    inv = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(L, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def naive_rmsnorm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def naive_logits(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    """One document [L] -> logits [L, V], from the model's weights, with no packing anywhere."""
    cfg = model.cfg
    L, H, Hkv, D = tokens.numel(), cfg.n_head, cfg.n_kv_head, cfg.head_dim
    x = model.embed.weight[tokens]
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    for blk in model.blocks:
        a = blk.attn
        h = naive_rmsnorm(x, a.norm.weight, cfg.norm_eps) @ a.qkv.weight.T
        q = h[:, : H * D].reshape(L, H, D)
        k = h[:, H * D : (H + Hkv) * D].reshape(L, Hkv, D)
        v = h[:, (H + Hkv) * D :].reshape(L, Hkv, D)
        q, k = naive_rope(q, cfg.rope_base), naive_rope(k, cfg.rope_base)
        k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        x = x + torch.einsum("hqk,khd->qhd", p, v).reshape(L, H * D) @ a.proj.weight.T
        m = blk.mlp
        g, u = (naive_rmsnorm(x, m.norm.weight, cfg.norm_eps) @ m.gate_up.weight.T).chunk(2, -1)
        x = x + (g * torch.sigmoid(g) * u) @ m.down.weight.T
    return naive_rmsnorm(x, model.norm_f.weight, cfg.norm_eps) @ model.embed.weight.T


def make_model(**overrides) -> GPT:
    torch.manual_seed(0)
    # A larger init than GPT-2's makes every layer matter to the logits (a wiring error cannot hide).
    return GPT(GPTConfig.preset("tiny", init_std=0.2, **overrides)).double()


def random_docs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize(
    "lengths, bin_size, capacity, multiple, kv",
    [
        ([7, 1, 20, 13], 48, 6, 1, None),  # ghost slots and tail rows
        ([16, 5, 11], 32, 3, 1, 2),  # full capacity, exact fill, GQA
        ([9, 3, 14], 48, 5, 4, 1),  # padded layout (cu_seqlens_*_padded), multi-query
        ([40], 40, 1, 1, None),  # one document filling the bin
    ],
)
@torch.no_grad()
def test_packed_forward_equals_per_document_naive(lengths, bin_size, capacity, multiple, kv):
    model = make_model(n_kv_head=kv)
    docs = random_docs(lengths)
    batch = PackedBatch.from_documents(docs, bin_size=bin_size, capacity=capacity, pad_to_multiple=multiple)
    logits = model(batch.tokens, batch.packed_seq_params)
    assert logits.shape == (bin_size, model.cfg.vocab_size) and logits.dtype == torch.float64
    host = batch.packed_seq_params.host_offsets
    starts = host.get("cu_seqlens_q_padded", host["cu_seqlens_q"])
    worst = 0.0
    for i, doc in enumerate(docs):
        rows = slice(starts[i], starts[i] + doc.numel())
        ref = naive_logits(model, doc)
        torch.testing.assert_close(logits[rows], ref, rtol=1e-10, atol=1e-10)
        worst = max(worst, float((logits[rows] - ref).abs().max()))
    assert worst < 1e-10


def test_loss_logprobs_and_grads_equal_naive():
    model = make_model(n_kv_head=2)
    docs = random_docs([12, 1, 25, 6], seed=1)
    batch = PackedBatch.from_documents(docs, bin_size=56, capacity=6)
    logits, loss = model(batch)

    # Reference: mean CE over every in-document next-token target, documents run one by one.
    ce_sum, n_targets, ref_logp = 0.0, 0, []
    for doc in docs:
        lg = naive_logits(model, doc)
        logp = torch.log_softmax(lg[:-1], -1).gather(-1, doc[1:, None]).squeeze(-1)
        ref_logp.append(logp)
        ce_sum = ce_sum - logp.sum()
        n_targets += doc.numel() - 1
    ref_loss = ce_sum / n_targets
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    assert batch.num_real_tokens == n_targets

    # Per-token logprobs: the label's logprob on rows with a target, exactly 0 elsewhere.
    lp = model.token_logprobs(batch)
    assert lp.dtype == torch.float32 and lp.shape == (56,)
    has_target = batch.labels != -100
    assert torch.all(lp[~has_target] == 0)
    torch.testing.assert_close(lp[has_target].double(), torch.cat(ref_logp), rtol=1e-5, atol=1e-5)

    # Grads through the ops' backward match the naive model's autograd.
    params = [model.embed.weight, model.blocks[0].attn.qkv.weight, model.blocks[1].mlp.down.weight]
    got = torch.autograd.grad(loss, params)
    want = torch.autograd.grad(ref_loss, params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


def test_forward_hidden_and_loss_from_hidden_compose_to_forward():
    model = make_model()
    batch = PackedBatch.from_documents(random_docs([10, 17]), bin_size=32, capacity=4)
    logits, loss = model(batch)
    hidden = model.forward_hidden(batch.tokens, batch.packed_seq_params)
    logits2, loss2 = model.loss_from_hidden(hidden, batch.labels, batch.loss_mask)
    assert torch.equal(logits, logits2) and torch.equal(loss, loss2)
    # Explicit loss_mask weights rows: masking one document drops exactly its targets from the mean.
    mask = batch.loss_mask.clone()
    mask[:10] = 0
    _, loss_b = model(batch.tokens, batch.packed_seq_params, batch.labels, mask)
    ce = F.cross_entropy(logits, batch.labels, ignore_index=-100, reduction="none")
    torch.testing.assert_close(loss_b, (ce * mask).sum() / mask.sum())


def test_documents_do_not_interact():
    """Changing one document's tokens leaves every other document's logits bit-identical."""
    model = make_model()
    docs = random_docs([9, 14, 6])
    base = PackedBatch.from_documents(docs, bin_size=32, capacity=4)
    docs2 = [docs[0], torch.randint(0, 256, (14,), generator=torch.Generator().manual_seed(7)), docs[2]]
    other = PackedBatch.from_documents(docs2, bin_size=32, capacity=4)
    a = model(base.tokens, base.packed_seq_params)
    b = model(other.tokens, other.packed_seq_params)
    assert torch.equal(a[:9], b[:9]) and torch.equal(a[23:29], b[23:29])
    assert not torch.equal(a[9:23], b[9:23])


def test_presets_and_config():
    shapes = {name: GPTConfig.preset(name) for name in PRESETS}
    assert (shapes["small"].d_model, shapes["small"].n_layer) == (512, 12)
    assert (shapes["medium"].d_model, shapes["medium"].n_layer) == (1024, 16)
    assert (shapes["large"].d_model, shapes["large"].n_layer) == (2048, 24)
    for cfg in shapes.values():
        assert cfg.mlp_hidden % 64 == 0 and cfg.mlp_hidden >= 8 * cfg.d_model / 3 > cfg.mlp_hidden - 64
        assert cfg.vocab_size == 258 and cfg.n_kv_head == cfg.n_head
    tiny = GPT(shapes["tiny"])
    distinct = {id(p): p for p in tiny.parameters()}.values()
    assert sum(p.numel() for p in distinct) == shapes["tiny"].num_params()
    assert tiny.logits_from_hidden(torch.zeros(3, 64)).shape == (3, 258)
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        GPTConfig.preset("huge")
    with pytest.raises(ValueError, match="multiple of n_kv_head"):
        GPTConfig(n_head=8, n_kv_head=3)


def test_block_halves_are_separate_modules():
    model = make_model()
    block = model.blocks[0]
    batch = PackedBatch.from_documents(random_docs([5, 8]), bin_size=16, capacity=2)
    x = torch.randn(16, 64, dtype=torch.float64)
    assert torch.equal(block(x, batch.packed_seq_params), block.mlp(block.attn(x, batch.packed_seq_params)))


def test_graphed_needs_cuda():
    model = GPT(GPTConfig.preset("tiny"))
    for scope in SCOPES:
        with pytest.raises(RuntimeError, match="CUDA"):
            model.graphed(scope=scope)


def test_tokens_need_params():
    model = GPT(GPTConfig.preset("tiny"))
    with pytest.raises(ValueError, match="packed_seq_params"):
        model(torch.zeros(4, dtype=torch.long))
    params = PackedSeqParams.from_seqlens([4])
    with pytest.raises(ValueError, match="1-D"):
        model(torch.zeros(1, 4, dtype=torch.long), params)


# ---------------------------------------------------------------------------------------------- graphed wiring
def graph_batches():
    g = torch.Generator().manual_seed(11)
    out = []
    for lengths, capacity, max_seqlen, multiple in (
        ([9, 1, 20], 4, 32, 1),
        ([30, 2], 4, 32, 1),  # same signature as the first: replays its graph set
        ([5] * 7, 8, 8, 1),  # another bucket: a second set
        ([12, 3], 4, 32, 4),  # padded layout: a third
    ):
        docs = [torch.randint(0, 256, (n,), generator=g) for n in lengths]
        out.append(
            PackedBatch.from_documents(
                docs, bin_size=48, capacity=capacity, max_seqlen=max_seqlen, pad_to_multiple=multiple
            )
        )
    return out


@pytest.mark.parametrize("scope", SCOPES)
def test_graphed_wrapper_wiring_equals_eager_on_a_cpu_stand_in(scope):
    model = make_model(n_kv_head=2)
    with use_recorder(EagerRecorder()):
        graphed = model.graphed(scope=scope)
        batches = graph_batches()
        for b in batches:  # capture every set first (recording runs the bodies here, see EagerRecorder)
            model.zero_grad(set_to_none=True)
            graphed(b)[1].backward()
    sets = graphed.num_graph_sets
    assert sets == (1 if scope == "mlp" else 3)
    for b in batches:
        model.zero_grad(set_to_none=True)
        _, loss = model(b)
        loss.backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        _, g_loss = graphed(b)
        g_loss.backward()
        torch.testing.assert_close(g_loss, loss, rtol=1e-12, atol=1e-12)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[n], rtol=1e-10, atol=1e-12, msg=n)
    assert graphed.num_graph_sets == sets and graphed.recaptures == 0  # replays only

    # Accumulation over micro-batches through the graphs equals eager accumulation.
    model.zero_grad(set_to_none=True)
    for b in batches:
        graphed(b)[1].backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for b in batches:
        model(b)[1].backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("scope", SCOPES)
def test_the_logging_pattern_keeps_each_loss_as_eager(scope):
    """``_, loss = graphed(batch); logged = loss.detach(); loss.backward()``, the commonest logging line of a
    training loop, with the detached losses kept in a list across steps: each is its step's eager loss."""
    model = make_model()
    batches = graph_batches()
    with use_recorder(EagerRecorder()):
        graphed = model.graphed(scope=scope)
        logged, grads = [], []
        for b in batches + batches:
            model.zero_grad(set_to_none=True)
            _, loss = graphed(b)
            logged.append(loss.detach())
            loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for i, b in enumerate(batches + batches):
        model.zero_grad(set_to_none=True)
        _, want = model(b)
        want.backward()
        torch.testing.assert_close(logged[i], want.detach(), rtol=1e-12, atol=1e-12)
        for n, p in model.named_parameters():
            torch.testing.assert_close(grads[i][n], p.grad, rtol=1e-10, atol=1e-12, msg=n)


def test_graphed_layers_capture_a_new_bucket_before_the_embedding(monkeypatch):
    """Scope ``"layer"``: a training call with a new bucket captures the block stack before it embeds the tokens
    (``GraphedCallable.capture_ahead``), so the capture never holds the embedding beside the stack's input buffer.
    Without grad the blocks capture at their calls, after the embedding. Losses and grads stay eager's."""
    model = make_model()
    first, second, third, _ = graph_batches()
    captures_at_embedding = []
    embed = model.embed_tokens

    with use_recorder(EagerRecorder()):
        graphed = model.graphed(scope="layer")

        def recording(tokens):
            captures_at_embedding.append(graphed.captures)
            return embed(tokens)

        monkeypatch.setattr(model, "embed_tokens", recording)
        graphed(first)[1].backward()  # the initial capture (at the first call, from sample inputs)
        graphed(second)[1].backward()  # same bucket: replays
        model.zero_grad(set_to_none=True)
        _, loss = graphed(third)  # a new bucket
        loss.backward()
        assert captures_at_embedding == [1, 1, 2]
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            graphed(graph_batches()[3])  # another new bucket, forward only: captured at the blocks' calls
        assert captures_at_embedding[-1] == 2 and graphed.captures == 3
    model.zero_grad(set_to_none=True)
    _, want = model(third)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("scope", SCOPES)
def test_graphed_training_with_a_frozen_embedding_follows_eager(scope):
    """LoRA-style fine-tuning freezes the embedding: the first block's input then does not require grad, a new
    signature for the head of the stack only. The stack is captured again whole (the later blocks' older graphs
    would replay over the new head graph's activations); losses and grads stay eager's, frozen weights get none."""
    model = make_model()
    batches = graph_batches()
    model.embed.weight.requires_grad_(False)
    with use_recorder(EagerRecorder()):
        graphed = model.graphed(scope=scope)
        for b in batches + batches:
            model.zero_grad(set_to_none=True)
            _, loss = graphed(b)
            loss.backward()
            got = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            _, want = model(b)
            want.backward()
            torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
            for n, p in model.named_parameters():
                assert (got[n] is None) == (p.grad is None), n
                if p.grad is not None:
                    torch.testing.assert_close(got[n], p.grad, rtol=1e-10, atol=1e-12, msg=n)
    assert got["embed.weight"] is None


@pytest.mark.parametrize("scope", ["layer", "attn", "model"])
def test_graphed_forward_only_logprobs_equal_eager_on_a_cpu_stand_in(scope):
    model = make_model()
    with use_recorder(EagerRecorder()):
        graphed = model.graphed(scope=scope, forward_only=True)
        for _ in range(2):
            for b in graph_batches():
                torch.testing.assert_close(graphed.token_logprobs(b), model.token_logprobs(b), rtol=0, atol=1e-6)
    assert graphed.num_graph_sets == 3


@pytest.mark.parametrize("scope, recompute", [(s, False) for s in SCOPES] + [("layer", True), ("model", True)])
def test_graphed_training_with_adamw_follows_eager_over_a_random_schedule(scope, recompute):
    """Two copies of one model, one eager and one graphed, trained with AdamW on the same random schedule: batches
    over several buckets (captured as they come, in the middle of a step too), one or two micro-batches, ``zero_grad``
    with and without ``set_to_none``. Losses, grads and weights stay eager's, step after step (float64); with
    ``recompute`` too, where the backward graphs run the forward again."""
    import copy
    import random

    rng = random.Random(3)
    pool = graph_batches()
    eager = make_model(n_kv_head=2)
    model = copy.deepcopy(eager)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, model)]
    with use_recorder(EagerRecorder()):
        graphed = model.graphed(scope=scope, recompute=recompute)
        for step in range(16):
            micro = [rng.choice(pool) for _ in range(rng.choice([1, 2]))]
            set_to_none = rng.random() < 0.6
            losses = []
            for runner, opt in ((eager, opts[0]), (graphed, opts[1])):
                opt.zero_grad(set_to_none=set_to_none)
                losses.append([])
                for b in micro:  # each micro-batch's backward before the next forward, as graphs need
                    losses[-1].append(runner(b)[1])
                    losses[-1][-1].backward()
            for a, b in zip(*losses, strict=True):
                torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=f"step {step}")
            for (n, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-12, msg=f"step {step} {n}")
            for opt in opts:
                opt.step()
            for p, q in zip(eager.parameters(), model.parameters(), strict=True):
                torch.testing.assert_close(q, p, rtol=1e-9, atol=1e-12)
    assert graphed.num_graph_sets >= (1 if scope == "mlp" else 2)
