"""graph_transformer_layers on the real Megatron-Core, driving the real engine on the CPU (EagerRecorder).

Reference: the same model run eagerly (a second instance with identical weights) on the same packed batches.
Recording with the stand-in runs the captured bodies, so each test captures every signature first (one pass over
its batches) and measures afterwards, with ``.grad`` cleared in between (see ``tests/eager_recorder.py``).
"""

import random
from itertools import pairwise

import pytest
import torch

pytest.importorskip("megatron.core")

from packgraph import default_buckets  # noqa: E402
from packgraph.graphs import use_recorder  # noqa: E402
from packgraph.integrations.megatron import (  # noqa: E402
    get_gpt_layer_packgraph_spec,
    graph_transformer_layers,
    megatron_rl_bin_params,
    to_megatron,
)
from packgraph.packing import PackedBatch  # noqa: E402
from tests.eager_recorder import EagerRecorder  # noqa: E402
from tests.megatron_shims import (  # noqa: E402
    PAD_ID,
    VOCAB,
    StandInMixer,
    gpt_model,
    hybrid_model,
    megatron_on_cpu,
    packed_logits,
    packed_loss,
    tiny_config,
)

T = 48
CAPACITY = 6


@pytest.fixture(scope="module", autouse=True)
def _megatron_cpu():
    with megatron_on_cpu():
        yield


def _twins(build):
    """Two instances of one model with identical weights: the one to graph and the eager reference."""
    graphed, eager = build(), build()
    eager.load_state_dict(graphed.state_dict(), strict=True)
    return graphed, eager


def _gpt(**config):
    return gpt_model(get_gpt_layer_packgraph_spec(), tiny_config(**config))


def _packings(n, seed, *, pad=1):
    """``n`` packed batches of ``T`` rows with varied document counts, lengths and dead tails."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        count = rng.randint(1, CAPACITY)
        end = T // pad - rng.randint(0, T // (4 * pad))
        cuts = sorted(rng.sample(range(1, end), count - 1))
        lengths = [(b - a) * pad - rng.randint(0, pad - 1) for a, b in pairwise([0, *cuts, end])]
        docs = [torch.randint(0, VOCAB - 1, (m,), generator=gen) for m in lengths]
        batches.append(
            PackedBatch.from_documents(
                docs, bin_size=T, capacity=CAPACITY, max_seqlen=T, pad_to_multiple=pad, pad_id=PAD_ID
            )
        )
    return batches


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    logits = packed_logits(model, batch)
    packed_loss(logits, batch).backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_same_steps(graphed, eager, batches):
    for batch in batches:  # capture every signature first: recording runs the bodies (EagerRecorder)
        _step(graphed, batch)
    for k, batch in enumerate(batches):
        logits, grads = _step(graphed, batch)
        ref_logits, ref_grads = _step(eager, batch)
        assert torch.equal(logits, ref_logits), f"logits of batch {k}"
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, ref_grads[name]), f"grad of {name}, batch {k}"


@pytest.mark.parametrize("scope", ["layer", "attn", "mlp"])
def test_graphed_layers_equal_eager(scope):
    graphed, eager = _twins(lambda: _gpt(add_bias_linear=True))
    batches = _packings(3, seed=1) + _packings(1, seed=2, pad=4)
    sample = megatron_rl_bin_params([5, 9], bin_size=T, max_sequences_per_bin=CAPACITY - 1)
    with use_recorder(EagerRecorder()):
        handle = graph_transformer_layers(graphed, sample, scope=scope, buckets=default_buckets(T), num_warmup_iters=1)
    layers = list(graphed.decoder.layers)
    part = {"layer": lambda layer: layer, "attn": lambda layer: layer.self_attention, "mlp": lambda layer: layer.mlp}
    assert handle.targets == [part[scope](layer) for layer in layers]
    assert all("forward" in t.__dict__ for t in handle.targets)
    assert len({id(g.group) for g in handle.graphed}) == 1  # one capture group: one pool, one cache policy
    _assert_same_steps(graphed, eager, batches)


@pytest.mark.parametrize("recorder", ["eager", "op-replay"])
def test_full_recomputation_runs_inside_the_graphs(recorder):
    """``recompute_granularity="full"``: eager Megatron re-runs each layer in the backward (its block checkpoints
    them); graphed, each layer's backward graph recomputes it instead, with the same logits and grads. The block's
    own recomputation is off while the layers are graphed, and back after ``remove()``."""
    from tests.eager_recorder import OpReplayRecorder

    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    graphed, eager = _twins(lambda: _gpt(**full))
    batches = _packings(3, seed=6)
    stand_in = EagerRecorder() if recorder == "eager" else OpReplayRecorder()
    with use_recorder(stand_in):
        handle = graph_transformer_layers(graphed, batches[0].packed_seq_params, buckets=default_buckets(T))
        assert all(g.recompute for g in handle.graphed)
        assert graphed.decoder.config.recompute_granularity is None
        assert graphed.decoder.layers[0].config.recompute_granularity == "full"
        _assert_same_steps(graphed, eager, batches)
    handle.remove()
    assert graphed.decoder.config.recompute_granularity == "full"
    for options in (dict(scope="attn"), dict(recompute=False)):
        with pytest.raises(NotImplementedError, match="scope='layer' and recompute"), use_recorder(EagerRecorder()):
            graph_transformer_layers(graphed, batches[0].packed_seq_params, **options)
    assert graphed.decoder.config.recompute_granularity == "full"


def test_megatron_params_sample_and_padded_layouts():
    graphed, eager = _twins(lambda: _gpt(num_query_groups=1))
    batches = _packings(3, seed=3, pad=4)
    sample = to_megatron(batches[0].packed_seq_params.attention_view())  # no total_tokens: T is given
    with use_recorder(EagerRecorder()):
        handle = graph_transformer_layers(graphed, sample, scope="layer", buckets=default_buckets(T), total_tokens=T)
    assert handle.rows == T
    _assert_same_steps(graphed, eager, batches)


def test_remove_restores_the_eager_layers():
    graphed, eager = _twins(_gpt)
    batch = _packings(1, seed=4)[0]
    with use_recorder(EagerRecorder()):
        handle = graph_transformer_layers(graphed, batch.packed_seq_params, scope="attn")
    targets = list(handle.targets)
    handle.remove()
    assert all("forward" not in t.__dict__ for t in targets) and handle.graphed == []
    assert torch.equal(packed_logits(graphed, batch), packed_logits(eager, batch))
    with use_recorder(EagerRecorder()), graph_transformer_layers(graphed, batch.packed_seq_params) as again:
        assert again.targets == list(graphed.decoder.layers)
    assert all("forward" not in layer.__dict__ for layer in graphed.decoder.layers)


def test_hybrid_model_graphs_its_transformer_layers_and_keeps_the_mixer_eager():
    config = tiny_config(num_layers=3)
    graphed, eager = _twins(lambda: hybrid_model(get_gpt_layer_packgraph_spec(), config, "*M*"))
    batches = _packings(3, seed=5)
    with use_recorder(EagerRecorder()):
        handle = graph_transformer_layers(graphed, batches[0].packed_seq_params, buckets=default_buckets(T))
    layers = list(graphed.decoder.layers)
    assert handle.targets == [layers[0], layers[2]]
    mixer = layers[1]
    assert isinstance(mixer, StandInMixer) and "forward" not in mixer.__dict__
    mixer.seen_params.clear()
    _assert_same_steps(graphed, eager, batches)
    # the mixer ran eagerly on every call, with Megatron's params as the model passed them
    assert mixer.seen_params and all(type(p).__module__.startswith("megatron.") for p in mixer.seen_params)


# ---------------------------------------------------------------------------------------------------- refusals
def test_graphed_layers_refuse_calls_they_cannot_replay():
    graphed = _gpt()
    batch = _packings(1, seed=6)[0]
    params = to_megatron(batch.packed_seq_params.attention_view())
    with use_recorder(EagerRecorder()):
        graph_transformer_layers(graphed, batch.packed_seq_params)
    with pytest.raises(ValueError, match="attention_mask=None"):
        graphed(
            batch.tokens[None],
            batch.position_ids[None],
            torch.ones(1, 1, T, T, dtype=torch.bool),
            packed_seq_params=params,
        )
    with pytest.raises(ValueError, match="runs packed THD batches"):
        graphed(batch.tokens[None], batch.position_ids[None], None)
    with pytest.raises(ValueError, match="already replaced"), use_recorder(EagerRecorder()):
        graph_transformer_layers(graphed, batch.packed_seq_params)


def test_refuses_models_it_cannot_graph():
    batch = _packings(1, seed=7)[0]
    with pytest.raises(ValueError, match="scope must be one of"):
        graph_transformer_layers(_gpt(), batch.packed_seq_params, scope="block")
    recomputing = _gpt()
    recomputing.config.recompute_granularity = "selective"
    with pytest.raises(NotImplementedError, match="recompute_granularity='selective'"):
        graph_transformer_layers(recomputing, batch.packed_seq_params)
    megatron_graphs = _gpt()
    megatron_graphs.config.cuda_graph_impl = "local"
    with pytest.raises(NotImplementedError, match="Megatron's own CUDA graphs"):
        graph_transformer_layers(megatron_graphs, batch.packed_seq_params)
    with pytest.raises(ValueError, match="no decoder.layers"):
        graph_transformer_layers(torch.nn.Linear(2, 2), batch.packed_seq_params)


def test_the_samples_signature_serves_a_call_on_the_same_batch():
    """The sample fixes the hidden states' rows from its total_tokens (T), so a call on that batch replays the
    captured graph instead of capturing another."""
    graphed, eager = _twins(lambda: _gpt())
    batches = _packings(2, seed=5)
    with use_recorder(EagerRecorder()):
        handle = graph_transformer_layers(
            graphed, batches[0].packed_seq_params, buckets=default_buckets(T), num_warmup_iters=1
        )
    _step(graphed, batches[0])
    assert [g.captures for g in handle.graphed] == [1] * len(handle.graphed)
    assert handle.num_signatures == 1


@pytest.mark.parametrize("scope", ["layer", "attn"])
def test_graphed_layers_train_like_eager_over_a_random_schedule(scope):
    """Megatron twins trained with AdamW on one random schedule: packings of several signatures (plain and padded
    layouts, captured as they come), one or two micro-batches, both ``zero_grad`` modes. Logits, grads and weights
    stay the eager twin's."""
    graphed, eager = _twins(_gpt)
    pool = _packings(6, seed=4) + _packings(2, seed=5, pad=4)
    sample = megatron_rl_bin_params([5, 9], bin_size=T, max_sequences_per_bin=CAPACITY - 1)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, graphed)]
    rng = random.Random(3)
    with use_recorder(EagerRecorder()):
        handle = graph_transformer_layers(graphed, sample, scope=scope, buckets=default_buckets(T), num_warmup_iters=1)
        for step in range(14):
            micro = [rng.choice(pool) for _ in range(rng.choice([1, 2]))]
            set_to_none = rng.random() < 0.6
            logits = []
            for model, opt in ((eager, opts[0]), (graphed, opts[1])):
                opt.zero_grad(set_to_none=set_to_none)
                for batch in micro:
                    out = packed_logits(model, batch)
                    packed_loss(out, batch).backward()
                    logits.append(out.detach())
            for a, b in zip(logits[: len(micro)], logits[len(micro) :], strict=True):
                torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, msg=f"step {step}")
            for (name, p), q in zip(graphed.named_parameters(), eager.parameters(), strict=True):
                assert (p.grad is None) == (q.grad is None), name
                if p.grad is not None:
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")
            for opt in opts:
                opt.step()
    assert max(g.num_graphs for g in handle.graphed) >= 2
    handle.remove()
