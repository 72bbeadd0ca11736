"""Megatron-Core's ``DistributedDataParallel`` over layers graphed by ``graph_transformer_layers``, on CPU with gloo.

Each rank runs a tiny Megatron ``GPTModel`` (packgraph's layer spec, two layers, fp32) inside Megatron's DDP: the
grads reach the contiguous ``main_grad`` buffers through DDP's hooks on each parameter's ``AccumulateGrad``,
``finish_grad_sync`` all-reduces them (at the end of the step, or launched from those hooks during the backward in
one bucket or several), and SGD steps on ``main_grad``, as Megatron's optimizer does. After every optimizer step,
each rank's parameters and reduced grads are compared:

* graphed, against one process trained eagerly, without DDP, on the union of every rank's batches of the step
  (within fp32 rounding: the sums run in another order);
* graphed, against the same rank's eager model inside the same Megatron DDP, bitwise.

The loss is normalised by the global target count, so the ranks' grads must be summed (``_config`` says how
Megatron's DDP is set up for that), either in the loss before the backward or, as Megatron's
``finalize_model_grads`` does, with ``scale_gradients`` after the reduction. Micro-batches: several
forward/backward per step, all but the last under ``no_sync()``, add into ``main_grad`` before the one reduction.
Signatures first met after DDP wrapped the model are captured with DDP's hooks in place. Both CPU stand-in
recorders run; the op-replay one replays the recorded aten ops and no Python, as a CUDA graph does.

``gradient_accumulation_fusion`` is off throughout: it needs Megatron's fused weight-grad CUDA kernel (the wgrad
GEMM adds into ``main_grad`` inside the layer's backward, so inside the graph), which has no CPU path; and
``graph_transformer_layers`` refuses it (the last test), as docs/distributed.md explains.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("megatron.core")

# The module, not its EagerRecorder name: tests/conftest.py would run every test of a module that imports that
# name twice, and these tests pick their recorder themselves.
import tests.eager_recorder as stand_ins  # noqa: E402
from packgraph import default_buckets  # noqa: E402
from packgraph.distributed import global_token_count, shard_batches  # noqa: E402
from packgraph.graphs import use_recorder  # noqa: E402
from packgraph.integrations.megatron import get_gpt_layer_packgraph_spec, graph_transformer_layers  # noqa: E402
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

T, CAPACITY = 32, 4
STEPS, LR = 3, 0.1
TOLERANCE = 5e-6  # of each tensor's largest magnitude: fp32 sums in another order (seen: under 5e-7)
RECORDERS = {"eager": stand_ins.EagerRecorder, "op-replay": stand_ins.OpReplayRecorder}
DDP_CONFIGS = {
    "sync": dict(overlap_grad_reduce=False),  # one all-reduce of the whole buffer, in finish_grad_sync
    "overlap": dict(overlap_grad_reduce=True),  # one bucket, launched by the hook of the last grad to arrive
    "overlap-buckets": dict(overlap_grad_reduce=True, bucket_size=2000),  # 8 buckets, launched during the backward
}


def _batches(world: int, micro: int) -> list[PackedBatch]:
    """``STEPS * world * micro`` packed batches of ``T`` rows with very different target counts, in the order
    ``shard_batches`` deals them. Under ``default_buckets(T)`` a batch of one document has another capacity
    (another signature) than one of several: step 0 has only several-document batches (the sample's signature),
    step 1 only one-document batches (a signature every rank captures once DDP has run a step), and the later steps
    switch between the two from rank to rank and micro-batch to micro-batch."""
    gen = torch.Generator().manual_seed(0)
    several = [[9, 4, 2], [3, 3], [12, 7, 1, 5], [6, 20], [2, 2, 2, 2], [17, 9], [25, 3]]
    one = [[30], [17], [31], [8], [24], [12]]
    out = []
    for s in range(STEPS):
        for i in range(world * micro):  # micro-batch i // world of rank i % world
            single = s == 1 or (s > 1 and (i // world + i % world) % 2 == 0)
            pool = one if single else several
            docs = [torch.randint(0, VOCAB - 1, (k,), generator=gen) for k in pool[(s + i) % len(pool)]]
            out.append(PackedBatch.from_documents(docs, bin_size=T, capacity=CAPACITY, max_seqlen=T, pad_id=PAD_ID))
    return out


def _config(**extra):
    # The grads must be summed over the ranks. With calculate_per_token_loss Megatron's DDP scales nothing before
    # the reduction and reduces with SUM (gradient_scaling_factor 1.0; it refuses average_in_collective then).
    # Without it, each rank's main_grad is multiplied by 1/dp before a SUM (or reduced with AVG under
    # average_in_collective): an average, which a loss scaled by dp would undo only up to rounding where dp is not
    # a power of two.
    return tiny_config(calculate_per_token_loss=True, **extra)


def _model(device: str = "cpu", **config):
    return gpt_model(get_gpt_layer_packgraph_spec(), _config(**config), seed=1).to(device)


def _ddp(model, options: dict):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(_config(), DistributedDataParallelConfig(**options), model)


def _state(model) -> dict[str, torch.Tensor]:
    """Every parameter, and the grad the optimizer stepped on (DDP's reduced ``main_grad``, else ``.grad``)."""
    out = {}
    for name, p in getattr(model, "module", model).named_parameters():
        out[name] = p.detach().clone()
        out[f"{name} (grad)"] = (p.main_grad if hasattr(p, "main_grad") else p.grad).clone()
    return out


def _reference(
    batches: list[PackedBatch], world: int, micro: int, device: str = "cpu"
) -> list[dict[str, torch.Tensor]]:
    """One process, eager, no DDP: each step's ``world * micro`` batches as one union, its summed loss over its
    target count, SGD."""
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    per_step = world * micro
    for s in range(STEPS):
        union = [b.to(device) for b in batches[s * per_step : (s + 1) * per_step]]
        opt.zero_grad(set_to_none=True)
        loss = sum(packed_loss(packed_logits(model, b), b) for b in union) / sum(b.num_real_tokens for b in union)
        loss.backward()
        opt.step()
        out.append(_state(model))
    return out


def _train(ddp, batches: list[PackedBatch], rank: int, world: int, case: dict):
    """This rank's steps inside Megatron's DDP: the state after each step, and for each step whether each bucket
    group's reduction was already launched (from DDP's grad hooks) when the backward of the last micro-batch ended."""
    micro, device = case.get("micro", 1), case.get("device", "cpu")
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    states, launched = [], []
    for s in range(STEPS):
        step = batches[s * world * micro : (s + 1) * world * micro]
        mine = [b.to(device) for b in shard_batches(step, rank, world)]  # this rank's micro-batches of the step
        count = global_token_count(sum(b.num_real_tokens for b in mine))
        opt.zero_grad(set_to_none=True)  # the .grad set to main_grad below must not collect the next backward
        ddp.zero_grad_buffer()
        for i, b in enumerate(mine):
            with ddp.no_sync() if i < len(mine) - 1 else contextlib.nullcontext():
                loss = packed_loss(packed_logits(ddp, b), b)
                (loss if case["normalise"] == "grads" else loss / count).backward()
        launched.append([g.grad_reduce_handle is not None for g in ddp.bucket_groups])
        ddp.finish_grad_sync()
        if case["normalise"] == "grads":
            ddp.scale_gradients(1.0 / count)  # as finalize_model_grads does with calculate_per_token_loss
        for p in ddp.parameters():
            p.grad = p.main_grad
        opt.step()
        states.append(_state(ddp))
    return states, launched


def _assert_same(got, want, what: str, *, exact: bool) -> None:
    for s, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys(), what
        for name in g:
            if exact:
                assert torch.equal(g[name], w[name]), f"{what}: step {s}, {name}"
            else:
                scale = w[name].abs().max().item()
                torch.testing.assert_close(
                    g[name], w[name], rtol=0, atol=TOLERANCE * scale, msg=lambda m, n=name, s=s: f"{what}: {s} {n}: {m}"
                )


def _worker(rank: int, world: int, init: str, case: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        with megatron_on_cpu():  # on the world-size group started above: Megatron's data-parallel group is all ranks
            batches = _batches(world, case.get("micro", 1))
            want = _reference(batches, world, case.get("micro", 1))
            config = case.get("config", {})
            eager, eager_launched = _train(_ddp(_model(**config), case["ddp"]), batches, rank, world, case)

            model = _model(**config)
            scope = case.get("scope", "layer")
            with use_recorder(RECORDERS[case["recorder"]]()):
                ddp = _ddp(model, case["ddp"]) if case.get("wrap_first") else None
                handle = graph_transformer_layers(
                    model, batches[0].packed_seq_params, scope=scope, buckets=default_buckets(T)
                )
                if ddp is None:
                    ddp = _ddp(model, case["ddp"])
                captured_before = handle.captures
                graphed, launched = _train(ddp, batches, rank, world, case)
            signatures = 1 if scope == "mlp" else 2  # the MLP's graph takes the hidden states only: one signature
            assert handle.num_signatures == signatures and handle.captures == signatures * captured_before

            _assert_same(graphed, eager, f"rank {rank}, graphed against eager in Megatron's DDP", exact=True)
            _assert_same(graphed, want, f"rank {rank}, graphed against one process on the union", exact=False)
            overlap = case["ddp"]["overlap_grad_reduce"]
            # The first step learns which grads each bucket waits for and reduces in finish_grad_sync; from the
            # second on, DDP's hooks launch each bucket's all-reduce once its grads have all arrived.
            assert launched == eager_launched == [[overlap and s > 0] * len(ddp.bucket_groups) for s in range(STEPS)]
            assert len(ddp.bucket_groups) == (8 if "bucket_size" in case["ddp"] else 1)
    finally:
        dist.destroy_process_group()


def _run(world: int, *, ddp: str, recorder: str = "op-replay", normalise: str = "loss", **case) -> None:
    case = dict(case, ddp=DDP_CONFIGS[ddp], recorder=recorder, normalise=normalise)
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "init"), case), nprocs=world, start_method=method)


@pytest.mark.parametrize("recorder", list(RECORDERS))
@pytest.mark.parametrize("ddp", list(DDP_CONFIGS))
def test_two_ranks_equal_one_process_on_the_union(ddp, recorder):
    _run(2, ddp=ddp, recorder=recorder)


@pytest.mark.parametrize(
    "ddp,recorder", [("sync", "eager"), ("overlap", "op-replay"), ("overlap-buckets", "op-replay")]
)
def test_four_ranks_equal_one_process_on_the_union(ddp, recorder):
    _run(4, ddp=ddp, recorder=recorder, micro=2)


@pytest.mark.parametrize("recorder", list(RECORDERS))
@pytest.mark.parametrize("ddp", list(DDP_CONFIGS))
def test_micro_batches_add_into_main_grad_before_one_reduction(ddp, recorder):
    """Three forward/backward per rank and step, the first two under ``no_sync()``."""
    _run(2, ddp=ddp, recorder=recorder, micro=3)


@pytest.mark.parametrize("ddp", list(DDP_CONFIGS))
def test_megatron_scales_the_reduced_grads_by_the_global_count(ddp):
    """Megatron's own per-token recipe: the backward of each rank's summed loss, ``scale_gradients(1 / count)``
    after the reduction."""
    _run(2, ddp=ddp, normalise="grads", micro=2)


@pytest.mark.parametrize("ddp", list(DDP_CONFIGS))
def test_graphs_captured_inside_megatron_ddp(ddp):
    """DDP wraps the model before the layers are graphed: every capture and warm-up runs with DDP's hooks on the
    parameters' ``AccumulateGrad``, and must add nothing to ``main_grad``."""
    _run(2, ddp=ddp, wrap_first=True, micro=2)


@pytest.mark.parametrize("scope", ["attn", "mlp"])
@pytest.mark.parametrize("recorder", list(RECORDERS))
def test_attention_or_mlp_scope(scope, recorder):
    """Only ``self_attention`` or ``mlp`` graphed: the norms, residuals and the rest stay eager under DDP."""
    _run(2, ddp="overlap-buckets", recorder=recorder, scope=scope, micro=2)


@pytest.mark.parametrize("ddp", ["sync", "overlap-buckets"])
def test_full_recomputation_inside_the_graphs_under_megatron_ddp(ddp):
    """``recompute_granularity="full"``: eager Megatron DDP re-runs each layer in its backward through Megatron's
    checkpoint; graphed, each layer's backward graph recomputes it. Bitwise the same parameters and ``main_grad``."""
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    _run(2, ddp=ddp, micro=2, config=full)


def test_refuses_gradient_accumulation_fusion():
    with megatron_on_cpu():
        model = _model()
        model.config.gradient_accumulation_fusion = True  # set after the build: its CUDA extension is missing here
        with use_recorder(stand_ins.EagerRecorder()), pytest.raises(NotImplementedError, match="set it to False"):
            graph_transformer_layers(model, _batches(1, 1)[0].packed_seq_params)
        assert all("forward" not in layer.__dict__ for layer in model.decoder.layers)
