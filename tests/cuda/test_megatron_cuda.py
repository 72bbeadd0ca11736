"""GPU: Megatron-Core's GPTModel with the packgraph spec, under packgraph graphs (megatron-core carried).

References: the same model run eagerly (a second instance with the same weights) on the same packed batches.
Graph replays run the same kernels on the same inputs, so forward outputs are equal bit for bit, and gradients
differ only by FlashAttention's backward, which accumulates dq with atomics unless kernels are deterministic
(then whole training runs are bitwise equal). Tolerances are relative to each tensor's scale (bf16 has 8 mantissa
bits). The figures go to the gpu-check report; the 300-step loss curves (JSON + PNG) go next to the report file
(``megatron-packed-gpt/``) when gpu-check runs the tests, else to pytest's tmp dir.
"""

import dataclasses
import importlib.util
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from packgraph import default_buckets  # noqa: E402
from packgraph.data.corpus import VOCAB_SIZE  # noqa: E402
from packgraph.graphs import GraphCaptureError, find_host_syncs  # noqa: E402
from packgraph.integrations.megatron import (  # noqa: E402
    get_gpt_layer_packgraph_spec,
    graph_transformer_layers,
    megatron_rl_bin_params,
    to_megatron,
)

GRAD_RTOL = 2e-2


@pytest.fixture(scope="module")
def example():
    from examples import megatron_packed_gpt as module

    with module.megatron_parallel_state(0):
        yield module


def _small(example, **overrides):
    return dataclasses.replace(
        example.ExampleConfig(T=2048, d_model=256, layers=4, heads=8, query_groups=4), **overrides
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)


def _fwd_bwd(example, model, batch, params):
    model.zero_grad(set_to_none=True)
    logits = model(batch.tokens[None], batch.position_ids[None], None, packed_seq_params=params)[0]
    per_row = torch.nn.functional.cross_entropy(logits.float(), batch.labels.clamp_min(0), reduction="none")
    ((per_row * batch.loss_mask).sum() / batch.loss_mask.sum()).backward()
    return logits.detach()


@pytest.mark.parametrize("scope", ["layer", "attn"])
def test_graphed_equals_eager_over_100_varied_packings(example, scope, report):
    cfg = _small(example)
    batches = [b.to("cuda") for b in example.make_batches(cfg, count=100)]
    eager = example.build_model(cfg)
    graphed = example.build_model(cfg)
    graphed.load_state_dict(eager.state_dict())
    policy = default_buckets(cfg.T)
    sample = batches[0].packed_seq_params
    handle = graph_transformer_layers(graphed, sample, scope=scope, buckets=policy, max_graphs=policy.num_buckets)
    unequal, grad_diffs = [], []
    for batch in batches:
        params = to_megatron(batch.packed_seq_params.attention_view())
        ref = _fwd_bwd(example, eager, batch, params)
        out = _fwd_bwd(example, graphed, batch, params)
        unequal.append((out != ref).any())
        grads = [_rel(p.grad, q.grad) for p, q in zip(graphed.parameters(), eager.parameters(), strict=True)]
        grad_diffs.append(torch.stack(grads).max())
    unequal_logits = int(torch.stack(unequal).sum())  # one host read for all packings
    grad_diff = torch.stack(grad_diffs).max().item()
    buckets = len({b.bucket for b in batches})
    report(f"megatron graphed[{scope}] vs eager: packings with unequal logits (of 100)", unequal_logits)
    report(f"megatron graphed[{scope}] vs eager: max rel |param grad diff| (100 packings)", f"{grad_diff:.2e}")
    report(f"megatron graphed[{scope}]: signatures / buckets met", f"{handle.num_signatures} / {buckets}")
    assert unequal_logits == 0
    assert grad_diff <= GRAD_RTOL
    assert handle.num_signatures == buckets
    handle.remove()
    assert all("forward" not in t.__dict__ for t in handle.targets)


def _stock_rope_model(example, cfg):
    """The packgraph spec with Megatron's own SelfAttention back in place: its THD RoPE reads offsets on the host."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.attention import SelfAttention

    spec = get_gpt_layer_packgraph_spec()
    attention = dataclasses.replace(spec.submodules.self_attention, module=SelfAttention)
    spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))
    config = example.megatron_config(cfg)
    model = GPTModel(config, spec, vocab_size=VOCAB_SIZE, max_sequence_length=cfg.T, position_embedding_type="rope")
    return model.to(device="cuda", dtype=cfg.dtype)  # as build_model: every parameter in the run's dtype


def test_capture_with_megatrons_own_thd_rope_names_its_line(example, report):
    cfg = _small(example, layers=1)
    # a bin tiled by its sequences (Megatron's RoPE splits the whole stream by cu_seqlens, tail included)
    sample = megatron_rl_bin_params([700, 300, 48], bin_size=cfg.T, max_sequences_per_bin=7, device="cuda")
    with pytest.raises(GraphCaptureError) as info:
        graph_transformer_layers(_stock_rope_model(example, cfg), sample)
    where = info.value.location
    report("megatron own THD RoPE under capture: error names", f"{os.path.basename(where.filename)}:{where.lineno}")
    assert where.filename.endswith("rope_utils.py") and where.function == "_apply_rotary_pos_emb_thd"
    assert f"rope_utils.py:{where.lineno}" in str(info.value)


def test_packed_forward_backward_has_no_host_syncs(example, report):
    cfg = _small(example, layers=2)
    batch = example.make_batches(cfg, count=1)[0].to("cuda")
    params = to_megatron(batch.packed_seq_params.attention_view())
    model = example.build_model(cfg)
    syncs = find_host_syncs(lambda: _fwd_bwd(example, model, batch, params))
    report("megatron packgraph-spec fwd+bwd: host syncs", len(syncs))
    assert syncs == [], [str(s) for s in syncs]
    # the same check on Megatron's own THD RoPE finds it (the check can fail)
    sample = megatron_rl_bin_params([700, 300, 48], bin_size=cfg.T, max_sequences_per_bin=7, device="cuda")
    stock = _stock_rope_model(example, cfg)
    tiled = dataclasses.replace(batch, packed_seq_params=sample)
    found = find_host_syncs(lambda: _fwd_bwd(example, stock, tiled, to_megatron(sample.attention_view())))
    assert any(s.filename.endswith("rope_utils.py") for s in found), [str(s) for s in found]


def _artifacts(tmp_path: Path) -> Path:
    report_file = os.environ.get("PACKGRAPH_REPORT")
    return Path(report_file).parent / "megatron-packed-gpt" if report_file else tmp_path / "megatron-packed-gpt"


def test_deterministic_training_is_bitwise_equal_over_300_steps(example, tmp_path, report):
    cfg = _small(example, steps=300, scopes=("layer", "attn"), deterministic=True)
    out = _artifacts(tmp_path)
    summary = example.run(cfg, out_dir=out)
    eager = summary["runs"]["eager"]["losses"]
    report("megatron 300 steps deterministic: loss first -> last (eager)", f"{eager[0]:.4f} -> {eager[-1]:.4f}")
    report("megatron 300 steps deterministic: curves and plot", str(out))
    assert eager[-1] < eager[0]
    for name in ("graphed-layer", "graphed-attn"):
        row = summary["graphed"][name]
        report(f"megatron 300 steps deterministic: max |loss diff| {name} vs eager", row["max_abs_loss_diff"])
        report(f"megatron 300 steps deterministic: step speedup {name}", f"{row['speedup']:.2f}", "x")
        assert row["bitwise_equal"], name
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the runs
    assert (out / "losses.png").exists() or not _has_matplotlib()


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


SIZES = {
    "d512-L12-T2048": dict(d_model=512, layers=12, heads=8, query_groups=4, T=2048, steps=200),
    "d2048-L8-T8192": dict(d_model=2048, layers=8, heads=16, query_groups=8, T=8192, steps=50),
}


@pytest.mark.parametrize("size", sorted(SIZES))
def test_speedup_memory_and_graphs_against_eager_megatron(example, size, report):
    cfg = dataclasses.replace(example.ExampleConfig(), scopes=("layer",), **SIZES[size])
    summary = example.run(cfg)
    eager, graphed = summary["runs"]["eager"], summary["runs"]["graphed-layer"]
    row = summary["graphed"]["graphed-layer"]
    label = f"megatron {size} train step (fwd+bwd+AdamW)"
    report(f"{label}: eager Megatron", f"{eager['median_step_ms']:.2f}", "ms")
    report(f"{label}: packgraph graphed layers", f"{graphed['median_step_ms']:.2f}", "ms")
    report(f"{label}: speedup", f"{row['speedup']:.2f}", "x")
    report(f"{label}: graphs recorded over {cfg.steps} varied batches", row["graphs_captured"])
    report(f"{label}: signatures (buckets) over {cfg.steps} varied batches", row["signatures"])
    report(f"{label}: peak memory graphed / eager", f"{row['peak_memory_ratio']:.2f}", "x")
    report(f"{label}: first step (captures) graphed", f"{graphed['first_step_ms']:.0f}", "ms")
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in (eager, graphed))
    # not deterministic: the curves drift by kernel noise only (bf16 training amplifies it), never apart
    assert abs(graphed["losses"][-1] - eager["losses"][-1]) <= 0.1 * eager["losses"][-1]
    assert row["signatures"] <= default_buckets(cfg.T).num_buckets
