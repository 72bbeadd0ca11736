"""torch ``DistributedDataParallel`` over graphed layers, on CPU with gloo and the stand-in recorders.

The reference is one process trained on the union of every rank's batches (the GPT of tests/distributed/test_dp.py,
float64), eagerly. Each rank wraps the model, graphed or not, in DDP; its loss is the sum over its targets divided
by the global target count (``global_token_count``), times the world size because DDP averages the gradients it
all-reduces. After each optimizer step every rank's parameters must equal the reference's, graphed or eager, for
every graph scope, and under ``no_sync`` accumulation, ``find_unused_parameters`` and ``static_graph``. Both stand-ins
run: the op-replay one replays the recorded aten ops and no Python, as a CUDA graph does.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from packgraph.distributed import global_token_count, shard_batches
from packgraph.graphs import use_recorder
from packgraph.models.gpt import GPT, GPTConfig
from packgraph.packing import PackedBatch
from tests.eager_recorder import EagerRecorder, OpReplayRecorder

CFG = dict(vocab_size=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32)
STEPS, LR = 2, 0.05
RECORDERS = {"eager": EagerRecorder, "op-replay": OpReplayRecorder}


def _batches(n: int) -> list[PackedBatch]:
    """``n`` batches of one bucket (capacity 4, max_seqlen 32) with very different target counts."""
    gen = torch.Generator().manual_seed(0)
    shapes = [[9, 4, 2], [30], [3, 3], [12, 7, 1, 5], [6, 20], [2, 2, 2, 2], [17, 9], [25, 3]]
    out = []
    for lengths in (shapes * 2)[:n]:
        docs = [torch.randint(0, CFG["vocab_size"], (k,), generator=gen) for k in lengths]
        out.append(PackedBatch.from_documents(docs, bin_size=32, capacity=4, max_seqlen=32, pad_id=0))
    return out


def _model() -> GPT:
    torch.manual_seed(1)
    return GPT(GPTConfig(**CFG)).double()


def _reference(batches: list[PackedBatch], world: int, micro: int) -> list[dict[str, torch.Tensor]]:
    """One process, eager: each step's ``world * micro`` batches as one union, SGD; the parameters after each step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    per_step = world * micro
    for s in range(STEPS):
        union = batches[s * per_step : (s + 1) * per_step]
        logits = torch.cat([model(b.tokens, b.packed_seq_params) for b in union])
        labels = torch.cat([b.labels for b in union])
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="mean").backward()  # as GPT's loss
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _train_steps(model, run, batches, want, rank, world, micro, *, no_sync=None, full=lambda p: p) -> None:
    """SGD steps of ``run`` (``batch -> (logits, loss)``) on this rank's micro-batches of each step, every one but
    the last under ``no_sync()`` when given; after each step every parameter (``full(p)``: the whole tensor of a
    shard) must equal the reference's. DDP and FSDP2 both average over the ranks, so each micro-batch's loss is the
    rank's share of the global mean scaled back up by the world size."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for s in range(STEPS):
        step = batches[s * world * micro : (s + 1) * world * micro]
        mine = list(shard_batches(step, rank, world))  # this rank's micro-batches of the step
        count = global_token_count(sum(b.num_real_tokens for b in mine))
        opt.zero_grad(set_to_none=True)
        for i, b in enumerate(mine):
            last = i == micro - 1
            with no_sync() if no_sync is not None and not last else contextlib.nullcontext():
                _, loss = run(b)
                (loss * (b.num_real_tokens * world / count)).backward()
        opt.step()
        for n, p in model.named_parameters():
            torch.testing.assert_close(
                full(p).detach(), want[s][n], rtol=1e-5, atol=1e-8, msg=lambda m, n=n, s=s: f"step {s} {n}: {m}"
            )


def _worker(rank: int, world: int, init: str, case: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        micro = case.get("micro", 1)
        batches = _batches(STEPS * world * micro)
        want = _reference(batches, world, micro)
        model = _model()
        recorder = RECORDERS[case["recorder"]]() if case["scope"] else None
        with use_recorder(recorder) if recorder is not None else contextlib.nullcontext():
            module = model.graphed(scope=case["scope"], **case.get("graph", {})) if case["scope"] else model
            ddp = DDP(module, **case.get("ddp", {}))
            _train_steps(model, ddp, batches, want, rank, world, micro, no_sync=ddp.no_sync)
        # The reducer goes first, while the process group is still registered: a gloo group destroyed by the
        # reducer's destructor joins its worker thread holding the GIL, which that thread may need (a deadlock).
        del ddp, module
        gc.collect()
    finally:
        dist.destroy_process_group()


def _run(world: int, **case) -> None:
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "init"), case), nprocs=world, start_method=method)


GRAPHED = [(scope, recorder) for scope in ("layer", "attn", "mlp", "model") for recorder in RECORDERS]


@pytest.mark.parametrize("scope,recorder", [(None, None), *GRAPHED])
def test_ddp_two_ranks_equal_one_process_on_the_union(scope, recorder):
    _run(2, scope=scope, recorder=recorder)


def test_ddp_four_ranks_equal_one_process_on_the_union():
    _run(4, scope="layer", recorder="op-replay")


@pytest.mark.parametrize("scope,recorder", [("layer", "op-replay"), ("attn", "eager"), ("model", "op-replay")])
def test_no_sync_accumulation_equals_one_process(scope, recorder):
    """Two micro-batches per rank and step, the first under ``no_sync()``: DDP reduces once, at the last one."""
    _run(2, scope=scope, recorder=recorder, micro=2)


@pytest.mark.parametrize(
    "options,micro",
    [
        (dict(find_unused_parameters=True), 2),
        # static_graph with no_sync at the first step trips an internal assert of DDP's reducer eagerly too
        (dict(static_graph=True), 1),
        (dict(gradient_as_bucket_view=True), 2),
        (dict(bucket_cap_mb=0.001), 2),  # a bucket per parameter or two: all-reduces overlap the graphed backward
    ],
    ids=lambda o: next(iter(o)) if isinstance(o, dict) else f"micro{o}",
)
@pytest.mark.parametrize("scope", ["layer", "attn"])
def test_ddp_options_work_as_eagerly(scope, options, micro):
    _run(2, scope=scope, recorder="op-replay", ddp=options, micro=micro)


@pytest.mark.parametrize("scope", ["layer", "attn"])
def test_ddp_with_recomputation_inside_the_graphs(scope):
    """Each graphed layer recomputes its forward inside its backward graph (``recompute=True``), under DDP."""
    _run(2, scope=scope, recorder="op-replay", graph=dict(recompute=True), micro=2)
