"""Data parallelism on CPU with gloo: 2 ranks reproduce single-process gradients on the union of their batches.

Also run as a module by the launch test: ``python -m tests.distributed.test_dp --probe DIR`` joins the group
through :func:`init_distributed` (inside torchrun) and writes what it saw to ``DIR/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from packgraph.distributed import (
    allreduce_gradients,
    broadcast_parameters,
    global_token_count,
    init_distributed,
    launch,
    shard_batches,
    shutdown_distributed,
    torchrun_command,
)
from packgraph.models.gpt import GPT, GPTConfig
from packgraph.packing import PackedBatch

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------------- one process
def test_shard_batches_round_robin_and_drop_last():
    items = list(range(7))
    assert [list(shard_batches(items, r, 3)) for r in range(3)] == [[0, 3], [1, 4], [2, 5]]
    assert [list(shard_batches(iter(items), r, 3, drop_last=False)) for r in range(3)] == [[0, 3, 6], [1, 4], [2, 5]]
    assert list(shard_batches(items, 0, 1)) == items
    with pytest.raises(ValueError, match="rank"):
        list(shard_batches(items, 3, 3))


def test_torchrun_command_drops_nproc_and_sets_module():
    cmd = torchrun_command(4, ["train", "--steps", "3", "--nproc", "4", "--nproc=4", "--lr", "1e-3"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc_per_node=4" in cmd and "--standalone" in cmd
    assert cmd[cmd.index("-m", 3) :] == ["-m", "packgraph.cli", "train", "--steps", "3", "--lr", "1e-3"]
    with pytest.raises(ValueError):
        torchrun_command(0, [])


def test_single_process_helpers_are_identity(monkeypatch):
    lin = nn.Linear(3, 2)
    lin(torch.ones(1, 3)).sum().backward()
    before = lin.weight.grad.clone()
    allreduce_gradients(lin)
    assert torch.equal(lin.weight.grad, before)
    assert global_token_count(5).item() == 5
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ctx = init_distributed(device="cpu")
    assert (ctx.world_size, ctx.rank, ctx.initialized, ctx.device.type) == (1, 0, False, "cpu")


# ---------------------------------------------------------------------------------------------------- multi-process
CFG = dict(vocab_size=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32)
WORLD = 2


def _batches() -> list[PackedBatch]:
    """Five batches with very different target counts (so a mean of per-rank means would be wrong)."""
    gen = torch.Generator().manual_seed(0)
    doc_lengths = [[9, 4, 2], [30], [3, 3], [12, 7, 1, 5], [6]]  # the 5th is dropped by drop_last with 2 ranks
    out = []
    for lengths in doc_lengths:
        docs = [torch.randint(0, CFG["vocab_size"], (n,), generator=gen) for n in lengths]
        out.append(PackedBatch.from_documents(docs, bin_size=32, capacity=4, max_seqlen=32, pad_id=0))
    return out


def _model() -> GPT:
    torch.manual_seed(1)
    return GPT(GPTConfig(**CFG)).double()


def _reference_grads(batches: list[PackedBatch]) -> dict[str, torch.Tensor]:
    """One process, the union of the batches: mean cross-entropy over every target token."""
    model = _model()
    logits = torch.cat([model(b.tokens, b.packed_seq_params) for b in batches])
    labels = torch.cat([b.labels for b in batches])
    F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="mean").backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _dp_worker(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        batches = _batches()
        mine = list(shard_batches(batches, rank, world))
        used = batches[: len(batches) // world * world]
        assert len(mine) == len(used) // world

        model = _model()
        if rank != 0:  # a different init on the other ranks: broadcast_parameters must fix it
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        broadcast_parameters(model, src=0)

        local = sum(b.num_real_tokens for b in mine)
        count = global_token_count(local)
        assert count.item() == sum(b.num_real_tokens for b in used)
        for b in mine:
            _, loss = model(b)
            (loss * (b.num_real_tokens / count)).backward()
        allreduce_gradients(model, bucket_cap_mb=1e-3)  # ~1 kB buckets: several collectives

        want = _reference_grads(used)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-8, msg=lambda m, n=name: f"{n}: {m}")

        # The test can fail: averaging per-rank means (DDP's default with a local-mean loss) is measurably off.
        naive = _model()
        for b in mine:
            (naive(b)[1] / len(mine)).backward()
        allreduce_gradients(naive, average=True)
        head = "embed.weight"
        diff = (dict(naive.named_parameters())[head].grad - want[head]).abs().max().item()
        assert diff > 1e-4, diff

        # A parameter only one rank uses: the other contributes zeros instead of hanging or skipping it.
        lin = nn.Linear(2, 2, bias=False).double()
        with torch.no_grad():
            lin.weight.fill_(1.0)
        if rank == 0:
            lin(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
        allreduce_gradients(lin)
        torch.testing.assert_close(lin.weight.grad, torch.ones(2, 2, dtype=torch.float64))

        # A parameter no rank uses keeps .grad None, as single-process: AdamW must not decay or move it.
        used, unused = nn.Linear(2, 2).double(), nn.Linear(2, 2).double()
        opt = torch.optim.AdamW([*used.parameters(), *unused.parameters()], lr=0.1, weight_decay=0.1)
        before = unused.weight.detach().clone()
        used(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
        allreduce_gradients([*used.parameters(), *unused.parameters()])
        assert unused.weight.grad is None and unused.bias.grad is None
        assert used.weight.grad is not None
        opt.step()
        torch.testing.assert_close(unused.weight.detach(), before, rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


def _start(fn, world: int) -> None:
    # fork skips re-importing torch in every child (seconds each on a busy 2-core box); the workers use CPU only.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(fn, args=(world, os.path.join(tmp, "init")), nprocs=world, start_method=method)


def test_dp_two_ranks_equal_single_process_on_the_union():
    _start(_dp_worker, WORLD)


def test_launch_runs_torchrun_and_init_distributed(tmp_path):
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    code = launch(2, ["--probe", str(tmp_path)], module="tests.distributed.test_dp", subcommand=None, env=env)
    assert code == 0
    seen = sorted((json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)), key=lambda d: d["rank"])
    assert [d["rank"] for d in seen] == [0, 1]
    for d in seen:
        assert d == dict(rank=d["rank"], world_size=2, local_rank=d["rank"], backend="gloo", rank_sum=1, nvls="0")


def _probe(out: str) -> None:
    ctx = init_distributed(device="cpu")
    total = torch.tensor(ctx.rank)
    dist.all_reduce(total)
    info = dict(
        rank=ctx.rank,
        world_size=ctx.world_size,
        local_rank=ctx.local_rank,
        backend=ctx.backend,
        rank_sum=int(total),
        nvls=os.environ.get("NCCL_NVLS_ENABLE"),
    )
    Path(out, f"rank{ctx.rank}.json").write_text(json.dumps(info))
    shutdown_distributed()


if __name__ == "__main__" and sys.argv[1:2] == ["--probe"]:
    _probe(sys.argv[2])
