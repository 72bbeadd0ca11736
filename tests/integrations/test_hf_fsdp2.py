"""``graph_decoder_layers`` on a Hugging Face Llama whose decoder layers are FSDP2 units, on CPU with gloo.

Each decoder layer is ``fully_shard``ed and so is the whole model, as accelerate's FSDP2 wraps it. The layers'
forwards are replaced by graphed ones: FSDP2's hooks on each layer gather its parameters, the graph reads copies of
them (docs/distributed.md), and FSDP2 reshards and reduce-scatters as it does eagerly. On 2 ranks, every rank's
gathered parameters after each SGD step must equal one process trained eagerly on the union of the ranks' batches,
for whole layers and for the attention and MLP halves, on the op-replay stand-in (it replays the recorded aten ops
and no Python, as a CUDA graph does).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers")
fsdp = pytest.importorskip("torch.distributed.fsdp")

from packgraph.graphs import use_recorder  # noqa: E402
from packgraph.integrations.hf import graph_decoder_layers, packed_forward  # noqa: E402
from packgraph.integrations.hf_families import documents, packed_batch, tiny_model  # noqa: E402
from tests.eager_recorder import OpReplayRecorder  # noqa: E402

STEPS, LR, TOTAL = 2, 0.05, 64
SHAPES = [(5, 17, 9), (30, 12), (7, 11, 20), (26, 2, 3, 8), (14, 6, 19), (28, 16)]


def _batches(n: int):
    return [
        packed_batch(documents(SHAPES[k % len(SHAPES)], seed=k), TOTAL, capacity=8, max_seqlen=32) for k in range(n)
    ]


def _summed_loss(model, batch):
    """The sum of the batch's per-target losses (packed_forward's mean times its target count)."""
    out = packed_forward(model, batch, compute_loss=True)
    return out.loss * batch.loss_mask.sum()


def _reference(batches, world: int) -> list[dict[str, torch.Tensor]]:
    model = tiny_model("llama").double().train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for s in range(STEPS):
        union = batches[s * world : (s + 1) * world]
        count = sum(b.loss_mask.sum() for b in union)
        opt.zero_grad(set_to_none=True)
        sum(_summed_loss(model, b) for b in union).div(count).backward()
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _worker(rank: int, world: int, init: str, scope: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        batches = _batches(STEPS * world)
        want = _reference(batches, world)
        model = tiny_model("llama").double().train()
        for layer in model.model.layers:
            fsdp.fully_shard(layer)
        fsdp.fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        with use_recorder(OpReplayRecorder()):
            handle = graph_decoder_layers(model, batches[0], scope=scope, num_warmup_iters=1)
            for s in range(STEPS):
                mine = batches[s * world : (s + 1) * world][rank]
                count = sum(b.loss_mask.sum() for b in batches[s * world : (s + 1) * world])
                opt.zero_grad(set_to_none=True)
                (_summed_loss(model, mine) * world / count).backward()  # FSDP2 averages its reduce-scatter
                opt.step()
                for n, p in model.named_parameters():
                    torch.testing.assert_close(p.full_tensor().detach(), want[s][n], rtol=1e-6, atol=1e-9, msg=n)
            assert [g.captures for g in handle.graphed] == [1] * len(model.model.layers)
            assert all(g.copies_params for g in handle.graphed)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("scope", ["layer", "attn", "mlp"])
def test_graphed_hf_layers_inside_fsdp2_train_as_one_process_on_the_union(scope):
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(2, os.path.join(tmp, "init"), scope), nprocs=2, start_method=method)
