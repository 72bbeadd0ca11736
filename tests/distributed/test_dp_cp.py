"""Data parallel x context parallel on one ``DeviceMesh`` (dp=2, cp=2: 4 gloo ranks), with torch DDP or FSDP2.

Each data-parallel rank takes its own batch of the step; the two context-parallel ranks of its group shard that
batch (``shard_thd_for_cp``) and the GPT runs its attention across them (``cp_varlen_attention``, RoPE on global
positions). Every rank's loss is the sum of cross-entropy over its local targets divided by the step's global
target count, and DDP sums the gradients over all four ranks (``summing_ddp`` on the whole mesh): context parallel
ranks hold partial grads of the same batch, data parallel ranks grads of different batches. FSDP2 shards each block
and the model over all four ranks alike, and its reduce-scatter sums the same grads (scaled back from its average).
After each step the parameters must equal one process trained eagerly on the union of the step's unsharded batches:
eager, and with graphed layers on the op-replay stand-in, whose graphs hold the all-gather (forward) and the
reduce-scatter (backward) of K/V, replayed in order as a CUDA graph replays NCCL's.
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
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from packgraph.distributed import global_token_count, shard_thd_for_cp, summing_ddp
from packgraph.graphs import use_recorder
from packgraph.models.gpt import GPT, GPTConfig
from packgraph.packing import PackedBatch
from tests.eager_recorder import OpReplayRecorder

CFG = dict(vocab_size=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32)
DP, CP, STEPS, LR = 2, 2, 2, 0.05


def _batches(n: int) -> list[PackedBatch]:
    """``n`` batches of one bucket; every layout length a multiple of ``2 * CP``, as sharding needs."""
    gen = torch.Generator().manual_seed(0)
    shapes = [[9, 4, 2], [30], [3, 3, 11], [12, 7, 1, 5], [6, 20], [2, 2, 2, 2]]
    out = []
    for lengths in (shapes * 2)[:n]:
        docs = [torch.randint(0, CFG["vocab_size"], (k,), generator=gen) for k in lengths]
        out.append(
            PackedBatch.from_documents(docs, bin_size=48, capacity=4, max_seqlen=32, pad_id=0, pad_to_multiple=2 * CP)
        )
    return out


def _model() -> GPT:
    torch.manual_seed(1)
    return GPT(GPTConfig(**CFG)).double()


def _loss_sum(model, tokens, params, labels, mask) -> torch.Tensor:
    logits = model(tokens, params)
    return (F.cross_entropy(logits.float(), labels.clamp_min(0), reduction="none") * mask).sum()


def _reference(batches: list[PackedBatch]) -> list[dict[str, torch.Tensor]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for s in range(STEPS):
        union = batches[s * DP : (s + 1) * DP]
        count = sum(int(b.loss_mask.sum()) for b in union)
        opt.zero_grad(set_to_none=True)
        loss = sum(_loss_sum(model, b.tokens, b.packed_seq_params, b.labels, b.loss_mask) for b in union) / count
        loss.backward()
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _worker(rank: int, world: int, init: str, graphed: bool, engine: str = "ddp") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (DP, CP), mesh_dim_names=("dp", "cp"))
        dp_rank, cp_rank = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
        cp_group = mesh["cp"].get_group()
        batches = _batches(STEPS * DP)
        want = _reference(batches)
        model = _model()
        scale = 1
        if engine == "fsdp2":
            # Sharded over every rank, dp and cp alike (one flat mesh, as torchtitan shards over dp x cp). FSDP2
            # averages its reduce-scatter: the loss is scaled back up by the world size.
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            scale = world
        with use_recorder(OpReplayRecorder()) if graphed else contextlib.nullcontext():
            blocks = model.graphed(scope="layer") if graphed else None
            step = _LossSum(model, blocks)
            # DDP over the whole mesh: dp and cp ranks alike
            ddp = summing_ddp(step) if engine == "ddp" else step
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            for s in range(STEPS):
                batch = batches[s * DP + dp_rank]
                local, params, _ = shard_thd_for_cp(batch, None, cp_rank, CP, cp_group=cp_group)
                count = global_token_count(int(local.loss_mask.sum()))  # each target counted on one rank
                opt.zero_grad(set_to_none=True)
                (ddp(local.tokens, params, local.labels, local.loss_mask) * scale / count).backward()
                opt.step()
                for n, p in model.named_parameters():
                    got = p.full_tensor() if isinstance(p, DTensor) else p
                    torch.testing.assert_close(
                        got.detach(), want[s][n], rtol=1e-5, atol=1e-8, msg=lambda m, n=n, s=s: f"step {s} {n}: {m}"
                    )
            del ddp, blocks  # the reducer before the group (tests/distributed/test_ddp_graphs.py)
            gc.collect()
    finally:
        dist.destroy_process_group()


class _LossSum(torch.nn.Module):
    """The local loss sum, through the graphed model when given: what DDP wraps. The graphed model's call runs an
    FSDP2 root's hooks around the embedding and the head, as the model's own call does."""

    def __init__(self, model: GPT, graphed=None) -> None:
        super().__init__()
        self.model, self.graphed = model, graphed

    def forward(self, tokens, params, labels, mask):
        if self.graphed is None:
            return _loss_sum(self.model, tokens, params, labels, mask)
        logits = self.graphed(tokens, params)
        return (F.cross_entropy(logits.float(), labels.clamp_min(0), reduction="none") * mask).sum()


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_dp_times_cp_on_one_mesh_equals_one_process_on_the_union(graphed, engine):
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(DP * CP, os.path.join(tmp, "init"), graphed, engine), nprocs=DP * CP,
                           start_method=method)  # fmt: skip


def _graphed_forward_worker(rank: int, world: int, init: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        model = _model()
        with use_recorder(OpReplayRecorder()):
            graphed = model.graphed(scope="layer")
            for batch in _batches(3):  # the first call captures, the others replay
                local, params, _ = shard_thd_for_cp(batch, None, rank, world, cp_group=dist.group.WORLD)
                with torch.no_grad():
                    want = model.forward_hidden(local.tokens, params)
                    got = graphed.forward_hidden(local.tokens, params)
                torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


def test_graphed_layers_with_context_parallel_replay_the_collectives():
    """The all-gather of K/V inside each layer graph replays in order (the stand-in waits on its Work, as a CUDA
    stream orders NCCL's): every call, the capturing one included, equals eager."""
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_graphed_forward_worker, args=(CP, os.path.join(tmp, "init")), nprocs=CP,
                           start_method=method)  # fmt: skip
