"""torch DDP over real CUDA graphs on one GPU: NCCL with world size 1, and gloo with 2 processes sharing the GPU
(NCCL refuses two ranks on one device).

The CPU tests (tests/distributed/test_ddp_graphs.py) run the same comparison on the stand-in recorders; here the
graphs are CUDA's. Each rank trains a float32 GPT, graphed (scope ``layer``, ``attn``, ``model``, and ``layer``
with recomputation) or eager, inside ``summing_ddp`` with two micro-batches per step (``no_sync`` on the first).
After every step its parameters are compared with one process trained eagerly on the union of the ranks' batches.
On CUDA the float32 attention runs packgraph's exact reference (FlashAttention takes half types only), so float32
rounding is the only difference.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

CFG = dict(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=64)
STEPS, MICRO, LR = 3, 2, 0.05
RUNS = [("eager", None, {}), ("layer", "layer", {}), ("attn", "attn", {}), ("model", "model", {}),
        ("layer+recompute", "layer", {"recompute": True})]  # fmt: skip
TOL = dict(rtol=1e-4, atol=1e-6)  # float32: the ranks' sum and the union's backward round differently


def _batches(n: int):
    from packgraph.packing import PackedBatch

    gen = torch.Generator().manual_seed(0)
    shapes = [[90, 40, 20], [250], [30, 30], [120, 70, 10, 50], [60, 180], [20, 20, 20, 20], [170, 80], [200, 30]]
    out = []
    for lengths in (shapes * 4)[:n]:
        docs = [torch.randint(0, CFG["vocab_size"], (k,), generator=gen) for k in lengths]
        out.append(PackedBatch.from_documents(docs, bin_size=256, capacity=8, max_seqlen=256, pad_id=0))
    return out


def _model():
    from packgraph.models.gpt import GPT, GPTConfig

    torch.manual_seed(1)
    return GPT(GPTConfig(**CFG)).cuda()


def _reference(batches, world):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out, per_step = [], world * MICRO
    for s in range(STEPS):
        union = [b.to("cuda") for b in batches[s * per_step : (s + 1) * per_step]]
        logits = torch.cat([model(b.tokens, b.packed_seq_params) for b in union])
        labels = torch.cat([b.labels for b in union])
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(logits.float(), labels, ignore_index=-100).backward()
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _compare(named, want: dict, where: str) -> float:
    """Assert every ``(name, tensor)`` of ``named`` close to ``want[name]``; the worst relative difference."""
    worst = 0.0
    for n, got in named:
        worst = max(worst, ((got - want[n]).abs().max() / want[n].abs().max()).item())
        torch.testing.assert_close(got, want[n], **TOL, msg=lambda m, w=f"{where} {n}": f"{w}: {m}")
    return worst


def _worker(rank: int, world: int, backend: str, init: str, out: str) -> None:
    from packgraph.graphs import loop_stream

    with loop_stream("cuda:0"):  # a chained stack replays only on the stream it was recorded on
        _ddp_worker(rank, world, backend, init, out)


def _train(model, run, batches, want, rank: int, world: int, label: str, *, no_sync=None, average=False) -> float:
    """SGD steps of ``run`` (``batch -> (logits, loss)``) on this rank's micro-batches of each step, every one but
    the last under ``no_sync()`` when given; after each step every parameter (the whole tensor of a shard) must be
    close to the reference's. ``average``: the engine averages the grads over the ranks (FSDP2), so each
    micro-batch's loss is scaled back up by the world size. The worst relative difference over the steps."""
    from packgraph.distributed import global_token_count, shard_batches

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    worst = 0.0
    for s in range(STEPS):
        step = batches[s * world * MICRO : (s + 1) * world * MICRO]
        mine = [b.to("cuda") for b in shard_batches(step, rank, world)]
        count = global_token_count(sum(b.num_real_tokens for b in mine), device="cuda")
        opt.zero_grad(set_to_none=True)
        for i, b in enumerate(mine):
            with no_sync() if no_sync is not None and i < len(mine) - 1 else contextlib.nullcontext():
                _, loss = run(b)
                (loss * (b.num_real_tokens * (world if average else 1) / count)).backward()
        opt.step()
        named = ((n, getattr(p, "full_tensor", p.detach)().detach()) for n, p in model.named_parameters())
        worst = max(worst, _compare(named, want[s], f"{label} step {s}"))
    return worst


def _ddp_worker(rank: int, world: int, backend: str, init: str, out: str) -> None:
    from packgraph.distributed import summing_ddp

    torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world)
    worst: dict[str, float] = {}
    try:
        batches = _batches(STEPS * world * MICRO)
        want = _reference(batches, world)
        for label, scope, opts in RUNS:
            model = _model()
            runner = model.graphed(scope=scope, **opts) if scope else model
            ddp = summing_ddp(runner, device_ids=[0])
            worst[label] = _train(model, ddp, batches, want, rank, world, label, no_sync=ddp.no_sync)
            del ddp, runner
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(worst))
        dist.destroy_process_group()


@pytest.mark.parametrize("backend,world", [("nccl", 1), ("gloo", 2)])
def test_ddp_over_graphed_layers_equals_one_process_on_the_union(backend, world, report):
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker, args=(world, backend, os.path.join(tmp, "init"), tmp), nprocs=world, start_method="spawn"
        )
        worst = json.loads(Path(tmp, "rank0.json").read_text())
    for label, err in worst.items():
        report(f"DDP {backend} world {world}, {label}: worst rel param diff vs one process", f"{err:.2e}")


def _fsdp2_worker(rank: int, world: int, init: str, out: str) -> None:
    """FSDP2 units (each block and the model) with graphed layers in every scope but ``model``, against the same
    union reference: the graphs read copies of FSDP2's gathered parameters (docs/distributed.md)."""
    from torch.distributed.fsdp import fully_shard

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world)
    worst: dict[str, float] = {}
    try:
        batches = _batches(STEPS * world * MICRO)
        want = _reference(batches, world)
        for label, scope in [("eager", None), ("layer", "layer"), ("attn", "attn"), ("mlp", "mlp")]:
            model = _model()
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            runner = model.graphed(scope=scope) if scope else model
            # FSDP2 averages its reduce-scatter
            worst[label] = _train(model, runner, batches, want, rank, world, f"FSDP2 {label}", average=True)
            if scope:
                assert [g.captures for g in runner.callables] == [1] * len(model.blocks), label
            del runner, model
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(worst))
        dist.destroy_process_group()


def test_fsdp2_over_graphed_layers_equals_one_process_on_the_union(report):
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_fsdp2_worker, args=(1, os.path.join(tmp, "init"), tmp), nprocs=1, start_method="spawn")
        worst = json.loads(Path(tmp, "rank0.json").read_text())
    for label, err in worst.items():
        report(f"FSDP2 nccl world 1, {label}: worst rel param diff vs one process", f"{err:.2e}")
