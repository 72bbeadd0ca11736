"""examples/megatron_packed_gpt.py with ``ddp=True`` (``--ddp`` under torchrun) on two gloo ranks of the CPU: each
rank trains inside Megatron's DistributedDataParallel on its share of each step's batches, eagerly and with graphed
layers (the re-running stand-in recorder). Both ranks log the same global losses, graphed equals eager, and the
losses are those of one process trained without DDP on the union of each step's batches (fp32: the ranks' summed
grads round in another order)."""

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("megatron.core")

WORLD, STEPS = 2, 4


def _example():
    from examples import megatron_packed_gpt as module

    return module


def _config(example, **overrides):
    fields = dict(steps=STEPS, T=128, d_model=32, layers=2, heads=4, query_groups=2, max_docs=30, device="cpu",
                  dtype=torch.float32)  # fmt: skip
    return example.ExampleConfig(**{**fields, **overrides})


def _rank(rank: int, init: str, out: str) -> None:
    from packgraph.graphs import use_recorder
    from tests.eager_recorder import EagerRecorder
    from tests.megatron_shims import megatron_on_cpu

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    try:
        with megatron_on_cpu():
            example = _example()
            cfg = _config(example, ddp=True)
            batches = example.make_batches(cfg)
            state = {k: v.clone() for k, v in example.build_model(cfg).state_dict().items() if v is not None}
            eager = example.train_run(cfg, state, batches)
            with use_recorder(EagerRecorder()):
                graphed = example.train_run(cfg, state, batches, scope="layer")
            torch.save({"eager": eager["losses"], "graphed": graphed["losses"]}, Path(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _one_process_on_the_union() -> list[float]:
    from tests.megatron_shims import megatron_on_cpu

    with megatron_on_cpu():
        example = _example()
        cfg = _config(example, ddp=False)
        batches = example.make_batches(cfg, STEPS * WORLD)
        model = example.build_model(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, foreach=True)
        losses = []
        for s in range(STEPS):
            union = batches[s * WORLD : (s + 1) * WORLD]
            count = torch.tensor(float(sum(b.num_real_tokens for b in union)))
            optimizer.zero_grad(set_to_none=True)
            loss = sum(example.packed_loss(model, b, example.to_megatron(b.packed_seq_params.attention_view()), count)
                       for b in union)  # fmt: skip
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def test_megatron_ddp_run_of_the_example_equals_one_process_on_the_union():
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(os.path.join(tmp, "init"), tmp), nprocs=WORLD, start_method="spawn")
        ranks = [torch.load(Path(tmp, f"rank{r}.pt")) for r in range(WORLD)]
    want = _one_process_on_the_union()
    for r, got in enumerate(ranks):
        assert got["graphed"] == got["eager"], f"rank {r}: graphed losses differ from eager inside Megatron's DDP"
        torch.testing.assert_close(torch.tensor(got["eager"]), torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert ranks[0]["eager"] == ranks[1]["eager"]
