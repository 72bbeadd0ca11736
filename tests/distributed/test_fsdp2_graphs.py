"""FSDP2 (``fully_shard``) with graphed layers, on CPU with gloo and the stand-in recorders.

FSDP2 gathers a unit's parameters into new storage for its forward and for its backward, and frees them after.
Graphed layers inside it read static copies of the gathered parameters, refreshed at every call, while FSDP2's
hooks (gather, reshard, reduce-scatter) run eagerly around the replay (docs/distributed.md).

Each block is an FSDP2 unit and so is the whole GPT (its root: the embedding and the head). The reference is one
process trained on the union of every rank's batches, eagerly (tests/distributed/test_ddp_graphs.py). After each
optimizer step, every rank's gathered parameters must equal the reference's, for graphed blocks (scope ``layer``)
and graphed halves (``attn``, ``mlp``: called inside their block's hooks), as they do for FSDP2 eagerly. A graph of
a module holding units below it is refused by name, and so are a graphed half called outside its unit's forward
and a graph of a model sharded after it was graphed.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

fsdp = pytest.importorskip("torch.distributed.fsdp")

from torch.distributed.tensor import DTensor  # noqa: E402

from packgraph.distributed import shard_batches  # noqa: E402
from packgraph.graphs import capture, use_recorder  # noqa: E402
from tests.distributed.test_ddp_graphs import (  # noqa: E402
    RECORDERS,
    STEPS,
    _batches,
    _model,
    _reference,
    _train_steps,
)
from tests.eager_recorder import OpReplayRecorder  # noqa: E402


def _sharded_model():
    model = _model()
    for block in model.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)
    return model


def _worker(rank: int, world: int, init: str, case: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        micro = case.get("micro", 1)
        batches = _batches(STEPS * world * micro)
        want = _reference(batches, world, micro)
        eager = _sharded_model()
        _train_steps(eager, eager, batches, want, rank, world, micro, full=DTensor.full_tensor)

        model = _sharded_model()
        with use_recorder(RECORDERS[case["recorder"]]()):
            graphed = model.graphed(scope=case["scope"], **case.get("graph", {}))
            _train_steps(model, graphed, batches, want, rank, world, micro, full=DTensor.full_tensor)
            # one capture per layer: the copies are refreshed in place, never a reason to capture again
            assert [g.captures for g in graphed.callables] == [1] * len(model.blocks)
            assert all(g.copies_params for g in graphed.callables)
            assert all(g.recompute == case.get("graph", {}).get("recompute", False) for g in graphed.callables)
    finally:
        dist.destroy_process_group()


def _spawn(world: int, case: dict, worker=_worker) -> None:
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(world, os.path.join(tmp, "init"), case), nprocs=world, start_method=method)


@pytest.mark.parametrize("scope", ["layer", "attn", "mlp"])
def test_graphed_fsdp2_units_train_as_one_process_on_the_union(scope):
    _spawn(2, {"scope": scope, "recorder": "op-replay"})


def test_graphed_fsdp2_on_four_ranks_with_micro_batches():
    _spawn(4, {"scope": "layer", "recorder": "op-replay", "micro": 2})


@pytest.mark.parametrize("scope", ["layer", "attn"])
def test_graphed_fsdp2_units_with_recomputation_inside_the_graphs(scope):
    """Each graphed unit recomputes its forward inside its backward graph (``recompute=True``), between FSDP2's
    gathers."""
    _spawn(2, {"scope": scope, "recorder": "op-replay", "graph": {"recompute": True}, "micro": 2})


def test_graphed_fsdp2_with_the_rerunning_stand_in():
    _spawn(2, {"scope": "layer", "recorder": "eager"})


def _refusals(rank: int, world: int, init: str, case: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        model = _sharded_model()
        batch = _batches(1)[0]
        with use_recorder(OpReplayRecorder()):
            # a module holding units: their gathers would run inside its graph
            with pytest.raises(NotImplementedError, match="Graph each unit"):
                model.graphed(scope="model")(batch)
            # a graphed half called outside its unit's forward, where its parameters are shards
            attn = capture(model.blocks[0].attn, (torch.zeros(32, 32, dtype=torch.float64), batch.packed_seq_params))
            with pytest.raises(RuntimeError, match="still sharded by FSDP2"):
                attn(torch.zeros(32, 32, dtype=torch.float64), batch.packed_seq_params)
            # sharded after its layers were graphed and had run: the graphs read the storage FSDP2 replaced
            late = _model()
            graphed = late.graphed(scope="layer")
            graphed(batch)
            for block in late.blocks:
                fsdp.fully_shard(block)
            fsdp.fully_shard(late)
            with pytest.raises(RuntimeError, match="Apply fully_shard first"):
                graphed(batch)
    finally:
        dist.destroy_process_group()


def test_what_fsdp2_cannot_graph_is_refused_by_name():
    _spawn(2, {}, worker=_refusals)


def _eager_rules(rank: int, world: int, init: str, case: dict) -> None:
    """Frozen parameters and ``no_grad`` through graphed FSDP2 units, against the same sharded model run eagerly
    on the same rank: the same losses, the same reduced grads, ``.grad`` left ``None`` where eager leaves it."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        batches = list(shard_batches(_batches(4 * world), rank, world))

        def build():
            model = _model()
            for p in (*model.blocks[0].attn.parameters(), model.blocks[1].mlp.gate_up.weight):
                p.requires_grad_(False)  # before sharding, as FSDP2 expects
            for block in model.blocks:
                fsdp.fully_shard(block)
            fsdp.fully_shard(model)
            return model

        eager, model = build(), build()
        with use_recorder(RECORDERS[case["recorder"]]()):
            graphed = model.graphed(scope=case["scope"])
            for b in batches[:3]:
                for m in (eager, model):
                    m.zero_grad(set_to_none=True)
                _, want = eager(b)
                _, got = graphed(b)
                want.backward()
                got.backward()
                torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
                for (name, pe), pg in zip(eager.named_parameters(), model.parameters(), strict=True):
                    assert (pg.grad is None) == (pe.grad is None), f"{name}: .grad None-ness differs from eager"
                    assert (pe.grad is None) == (not pe.requires_grad), name
                    if pe.grad is not None:
                        torch.testing.assert_close(pg.grad.full_tensor(), pe.grad.full_tensor(), rtol=1e-12, atol=0)
            with torch.no_grad():
                _, want = eager(batches[3])
                _, got = graphed(batches[3])
            assert not got.requires_grad
            torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("scope", ["layer", "attn"])
def test_frozen_parameters_and_no_grad_through_fsdp2_units_as_eagerly(scope):
    _spawn(2, {"scope": scope, "recorder": "op-replay"}, worker=_eager_rules)
