"""graph_decoder_layers on an HF Llama (d=512, 8 layers, GQA, bf16): graphed equals eager, and how much faster.

The reference is the same model run eagerly (a deep copy with identical weights) on the same packed batch, with
the same static params. Graph replays run the same kernels as eager, so the two agree up to the run-to-run
nondeterminism of FlashAttention's backward (atomic adds); tolerances are relative to each tensor's scale.
"""

import copy
import random
import statistics
from itertools import pairwise

import pytest
import torch

transformers = pytest.importorskip("transformers")

from packgraph.integrations.hf import graph_decoder_layers, packed_forward  # noqa: E402
from packgraph.packing import PackedBatch, fixed_shape_sample  # noqa: E402

T = 2048
CAPACITY = 32
VOCAB = 258
N_PACKINGS = 50
REL_TOL = 2e-2  # max |graphed - eager| / max |eager|, per tensor


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=T,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="packgraph")
    return model.to(device="cuda", dtype=torch.bfloat16)


def _packings(n: int, seed: int) -> list[PackedBatch]:
    """``n`` batches with varied document counts and lengths, all with one static signature (T, CAPACITY)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        count = rng.randint(1, CAPACITY)
        end = T - rng.randint(0, T // 4)  # a dead tail of up to T/4 rows
        cuts = sorted(rng.sample(range(1, end), count - 1))
        lengths = [b - a for a, b in pairwise([0, *cuts, end])]
        docs = [torch.randint(0, VOCAB, (m,), generator=gen) for m in lengths]
        batches.append(PackedBatch.from_documents(docs, bin_size=T, capacity=CAPACITY, max_seqlen=T).to("cuda"))
    return batches


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)


def _step(model, batch):
    out = packed_forward(model, batch, compute_loss=True)
    out.loss.backward()
    return out.logits.detach()


def test_graphed_training_equals_eager_over_packings(report):
    eager = _llama().train()
    graphed = copy.deepcopy(eager)
    sample = fixed_shape_sample(T, CAPACITY, max_seqlen=T, vocab_size=VOCAB, device="cuda")
    handle = graph_decoder_layers(graphed, sample)
    logit_diffs, grad_diffs = [], []
    for batch in _packings(N_PACKINGS, seed=1):
        eager.zero_grad(set_to_none=True)
        graphed.zero_grad(set_to_none=True)
        ref = _step(eager, batch)
        out = _step(graphed, batch)
        logit_diffs.append(_rel(out, ref))
        grad_diffs.append(
            torch.stack([_rel(p.grad, q.grad) for p, q in zip(graphed.parameters(), eager.parameters(), strict=True)])
        )
    logit_diff = torch.stack(logit_diffs).max().item()  # one host read for all packings
    grad_diff = torch.stack(grad_diffs).max().item()
    report("hf llama graphed vs eager: max rel |logits diff| (50 packings)", f"{logit_diff:.2e}")
    report("hf llama graphed vs eager: max rel |param grad diff| (50 packings)", f"{grad_diff:.2e}")
    assert logit_diff <= REL_TOL
    assert grad_diff <= REL_TOL

    # Step speedup: forward + backward of the whole model, median over steady-state steps.
    batches = _packings(25, seed=2)

    def timed(model):
        times = []
        for batch in batches:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            model.zero_grad(set_to_none=True)
            start.record()
            _step(model, batch)
            end.record()
            times.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in times[5:])

    eager_ms, graphed_ms = timed(eager), timed(graphed)
    report("hf llama d512 L8 T2048 step (fwd+bwd): eager", f"{eager_ms:.2f}", "ms")
    report("hf llama d512 L8 T2048 step (fwd+bwd): graphed layers", f"{graphed_ms:.2f}", "ms")
    report("hf llama d512 L8 T2048 step speedup", f"{eager_ms / graphed_ms:.2f}", "x")
    handle.remove()
    assert not any("forward" in layer.__dict__ for layer in graphed.model.layers)


def test_graphed_forward_only_scoring_equals_eager(report):
    eager = _llama().eval()
    graphed = copy.deepcopy(eager)
    sample = fixed_shape_sample(T, CAPACITY, max_seqlen=T, vocab_size=VOCAB, device="cuda")
    diffs = []
    with torch.no_grad(), graph_decoder_layers(graphed, sample, forward_only=True):
        for batch in _packings(10, seed=3):
            ref = packed_forward(eager, batch).logits
            out = packed_forward(graphed, batch).logits
            diffs.append(_rel(out, ref))
    diff = torch.stack(diffs).max().item()
    report("hf llama forward_only graphed vs eager: max rel |logits diff|", f"{diff:.2e}")
    assert diff <= REL_TOL


@pytest.mark.parametrize("scope", ["attn", "mlp"])
def test_partial_scopes_equal_eager(scope, report):
    eager = _llama().train()
    graphed = copy.deepcopy(eager)
    sample = fixed_shape_sample(T, CAPACITY, max_seqlen=T, vocab_size=VOCAB, device="cuda")
    diffs = []
    with graph_decoder_layers(graphed, sample, scope=scope):
        for batch in _packings(5, seed=4):
            eager.zero_grad(set_to_none=True)
            graphed.zero_grad(set_to_none=True)
            ref, out = _step(eager, batch), _step(graphed, batch)
            grads = [_rel(p.grad, q.grad) for p, q in zip(graphed.parameters(), eager.parameters(), strict=True)]
            diffs.append(torch.stack([_rel(out, ref), *grads]).max())
    diff = torch.stack(diffs).max().item()
    report(f"hf llama scope={scope} graphed vs eager: max rel diff (logits, grads)", f"{diff:.2e}")
    assert diff <= REL_TOL


def _graphed_against_eager(eager, batches, policy) -> tuple[float, int]:
    """Training steps of ``eager`` and of a copy with graphed decoder layers under ``policy``, over ``batches``: the
    worst relative difference (logits and every parameter grad) and the first layer's graph count."""
    graphed = copy.deepcopy(eager)
    diffs = []
    with graph_decoder_layers(graphed, batches[0], buckets=policy) as handle:
        for batch in batches:
            eager.zero_grad(set_to_none=True)
            graphed.zero_grad(set_to_none=True)
            ref, out = _step(eager, batch), _step(graphed, batch)
            grads = [_rel(p.grad, q.grad) for p, q in zip(graphed.parameters(), eager.parameters(), strict=True)]
            diffs.append(torch.stack([_rel(out, ref), *grads]).max())
        graphs_per_layer = handle.graphed[0].num_graphs
    return torch.stack(diffs).max().item(), graphs_per_layer


def test_bucketed_collator_batches_equal_eager(report):
    """DataCollatorWithFlattening -> from_flattening_batch(buckets=...) batches of several buckets: the engine
    captures one graph set per bucket at first use and replays it for the rest."""
    from packgraph.buckets import BucketPolicy
    from packgraph.integrations.hf import from_flattening_batch

    policy = BucketPolicy((512, T), (8, CAPACITY))
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    batches = []
    for i in range(16):  # cycles through the four buckets: (long doc or not) x (few or many docs)
        count = rng.randint(2, 8) if i % 4 < 2 else rng.randint(9, CAPACITY)
        first = rng.randint(513, 1024) if i % 2 == 0 else rng.randint(1, 512)
        lengths = [first] + [rng.randint(1, min(512, (T - first) // (count - 1))) for _ in range(count - 1)]
        docs = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()} for n in lengths]
        batches.append(from_flattening_batch(collator(docs), buckets=policy, total_tokens=T).to("cuda"))
    diff, graphs_per_layer = _graphed_against_eager(_llama().train(), batches, policy)
    buckets_used = len({b.bucket for b in batches})
    report("hf llama bucketed collator batches: max rel diff (logits, grads)", f"{diff:.2e}")
    report("hf llama bucketed collator batches: graphs per layer / buckets used", f"{graphs_per_layer}/{buckets_used}")
    assert diff <= REL_TOL
    assert graphs_per_layer == buckets_used


def test_autocast_bf16_over_float32_weights_equals_sdpa_per_document(report):
    """Trainer's bf16=True: float32 weights under bf16 autocast (q/k leave RoPE in float32, v in bf16). The packed
    forward, eager and graphed, against each document run alone through HF's own sdpa attention."""
    model = _llama().float().train()
    # from_config writes the implementation into the config it is given: the reference needs its own copy.
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(model.config), attn_implementation="sdpa")
    ref = ref.cuda()
    ref.load_state_dict(model.state_dict())
    graphed = copy.deepcopy(model)
    batch = _packings(1, seed=6)[0]
    docs = [batch.tokens[a:b] for a, b in pairwise(batch.packed_seq_params.cu_seqlens_q.tolist()) if b > a]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        handle = graph_decoder_layers(graphed, batch)
        eager_logits = packed_forward(model, batch).logits[0]
        graphed_logits = packed_forward(graphed, batch).logits[0]
        with torch.no_grad():
            per_doc = torch.cat([ref(input_ids=d.view(1, -1), use_cache=False).logits[0] for d in docs])
    n = per_doc.shape[0]
    vs_sdpa = _rel(eager_logits[:n], per_doc).item()
    vs_eager = _rel(graphed_logits, eager_logits).item()
    handle.remove()
    report(
        "hf llama bf16 autocast over fp32 weights: packed vs sdpa per document, max rel |logits diff|", f"{vs_sdpa:.2e}"
    )
    report("hf llama bf16 autocast: graphed vs eager packed, max rel |logits diff|", f"{vs_eager:.2e}")
    assert model.config._attn_implementation == "packgraph"
    assert vs_sdpa <= 5e-2  # two bf16 attention kernels (FA2 varlen, sdpa): rounding differs, documents must not mix
    assert vs_eager <= REL_TOL


def test_lora_through_peft_graphed_equals_packed_eager(report):
    """LoRA adapters (PEFT, r=16 on every projection) over a frozen bf16 Llama: adapter grads and logits as packed
    eager's, no frozen weight with a .grad, and the step speedup and peak memory of graphed layers."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    base = _llama()
    eager = peft.get_peft_model(base, config).train()
    graphed = copy.deepcopy(eager)
    sample = fixed_shape_sample(T, CAPACITY, max_seqlen=T, vocab_size=VOCAB, device="cuda")
    handle = graph_decoder_layers(graphed, sample)
    diffs = []
    for batch in _packings(10, seed=3):
        eager.zero_grad(set_to_none=True)
        graphed.zero_grad(set_to_none=True)
        ref, out = _step(eager, batch), _step(graphed, batch)
        diffs.append(_rel(out, ref))
        for (name, p), q in zip(graphed.named_parameters(), eager.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None) == (not p.requires_grad), name
            if p.grad is not None:
                diffs.append(_rel(p.grad, q.grad))
    worst = torch.stack(diffs).max().item()
    report("hf llama LoRA r16 graphed vs eager: max rel diff (logits, adapter grads)", f"{worst:.2e}")
    assert worst <= REL_TOL

    batches = _packings(25, seed=4)

    def timed(model):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for batch in batches:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            model.zero_grad(set_to_none=True)
            start.record()
            _step(model, batch)
            end.record()
            times.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in times[5:]), torch.cuda.max_memory_allocated()

    (eager_ms, eager_peak), (graphed_ms, graphed_peak) = timed(eager), timed(graphed)
    report(
        "hf llama LoRA r16 d512 L8 T2048 step (fwd+bwd): eager / graphed", f"{eager_ms:.2f} / {graphed_ms:.2f}", "ms"
    )
    report("hf llama LoRA r16 step speedup", f"{eager_ms / graphed_ms:.2f}", "x")
    report("hf llama LoRA r16 steady peak memory graphed / eager", f"{graphed_peak / eager_peak:.3f}")
    handle.remove()


def test_doc_mask_attention_graphed_needs_one_graph_per_layer(report):
    """``attn_implementation="packgraph_doc_mask"`` under ``document_mask_buckets(T)``: collator batches of 1 to 40
    documents share one bucket, so each layer has one graph for all of them, with eager's logits and grads."""
    from packgraph.buckets import document_mask_buckets
    from packgraph.integrations.hf import from_flattening_batch

    policy = document_mask_buckets(T)
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    rng = random.Random(6)
    gen = torch.Generator().manual_seed(6)
    batches = []
    for count in (1, 3, 40, 12, 2, 25):
        lengths = [rng.randint(1, T // count) for _ in range(count)]
        docs = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()} for n in lengths]
        batches.append(from_flattening_batch(collator(docs), buckets=policy, total_tokens=T).to("cuda"))
    eager = _llama().train()
    eager.set_attn_implementation("packgraph_doc_mask")
    diff, graphs_per_layer = _graphed_against_eager(eager, batches, policy)
    report("hf llama doc_mask attention, graphed vs eager: max rel diff (logits, grads)", f"{diff:.2e}")
    report("hf llama doc_mask attention: graphs per layer over 6 packings", graphs_per_layer)
    assert diff <= REL_TOL
    assert graphs_per_layer == 1
