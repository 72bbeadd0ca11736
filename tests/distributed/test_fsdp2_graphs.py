"""FSDP2 (``fully_shard``) and graphed layers, on CPU with gloo.

FSDP2 all-gathers a layer's parameters into new storage around its forward and backward and frees them after,
outside anything a graph replays. Until graphs can follow that, capturing a module FSDP2 shards raises a
``NotImplementedError`` naming FSDP2 and the fix (torch DDP), for a whole sharded layer and for a part of one
(whose parameters are DTensor shards). FSDP2 itself, eager, trains as one process on the union of the ranks'
batches here: the refusal is about graphs, not about the harness.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

fsdp = pytest.importorskip("torch.distributed.fsdp")

from packgraph.distributed import global_token_count, shard_batches  # noqa: E402
from packgraph.graphs import use_recorder  # noqa: E402
from tests.distributed.test_ddp_graphs import LR, STEPS, _batches, _model, _reference  # noqa: E402
from tests.eager_recorder import OpReplayRecorder  # noqa: E402


def _worker(rank: int, world: int, init: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        batches = _batches(STEPS * world)
        want = _reference(batches, world, 1)
        model = _model()
        for block in model.blocks:
            fsdp.fully_shard(block)
        fsdp.fully_shard(model)
        for scope in ("layer", "attn", "mlp"):
            with use_recorder(OpReplayRecorder()), pytest.raises(NotImplementedError, match="FSDP2") as info:
                model.graphed(scope=scope)(batches[rank])
            assert "DDP" in str(info.value)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for s in range(STEPS):
            mine = list(shard_batches(batches[s * world : (s + 1) * world], rank, world))
            count = global_token_count(sum(b.num_real_tokens for b in mine))
            opt.zero_grad(set_to_none=True)
            for b in mine:
                _, loss = model(b)
                (loss * (b.num_real_tokens * world / count)).backward()  # FSDP2 averages its reduce-scatter
            opt.step()
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.full_tensor().detach(), want[s][n], rtol=1e-5, atol=1e-8, msg=n)
    finally:
        dist.destroy_process_group()


def test_graphs_inside_fsdp2_are_refused_by_name_and_fsdp2_eager_trains_as_one_process():
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(2, os.path.join(tmp, "init")), nprocs=2, start_method=method)
