"""``PackgraphTrainer`` under several processes, as ``accelerate launch`` runs it: each rank joins through the
torchrun environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``), accelerate wraps the model in torch DDP
over gloo, and the decoder layers are graphed on the op-replay stand-in (it replays the recorded aten ops and no
Python, as a CUDA graph does).

On 2 and 4 ranks. The reference is one process with ``gradient_accumulation_steps`` equal to the world size on the
same rows: accelerate hands rank ``r`` batch ``r`` of every group of ``world`` in the (seeded, shared) sampler's
order, which is the group one process accumulates, and ``Trainer`` normalises the loss by the target tokens of the
step across the ranks (``average_tokens_across_devices``). Both runs, graphed and packed eager, must give the same
per-step losses and final parameters.
"""

import contextlib
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from packgraph.buckets import BucketPolicy  # noqa: E402
from packgraph.graphs import use_recorder  # noqa: E402
from packgraph.integrations.hf_families import documents, tiny_model  # noqa: E402
from packgraph.integrations.hf_trainer import PackgraphTrainer, pack_dataset  # noqa: E402
from tests.eager_recorder import OpReplayRecorder  # noqa: E402

TOTAL, STEPS = 64, 3
POLICY = BucketPolicy((32, 64), (8,))
LENGTHS = (5, 17, 1, 9, 12, 26, 30, 2, 7, 11, 20, 13, 8, 3, 25, 14, 6, 19, 4, 10, 28, 16)


def _rows():
    examples = [{"input_ids": d.tolist()} for d in documents(LENGTHS * 3, seed=5)]
    return pack_dataset(examples, TOTAL, buckets=POLICY)


def _train(
    out: Path, *, graphs: bool, accumulate: int, checkpointing: bool = False, device: str = "cpu", fsdp2: bool = False
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One run of ``PackgraphTrainer``: its logged losses and final parameters. On the CPU the graphs are the
    op-replay stand-in's; on CUDA they are real, and several ranks reduce over gloo (they share one GPU), or, with
    ``fsdp2``, accelerate shards each decoder layer and the model with FSDP2 over NCCL."""
    on_cpu = device == "cpu"
    fsdp = dict(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    # several ranks on one GPU reduce over gloo; a backend given to a single process makes accelerate look for a
    # process group that does not exist
    shared_gpu = not on_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1
    args = transformers.TrainingArguments(
        output_dir=str(out), use_cpu=on_cpu, per_device_train_batch_size=1, gradient_accumulation_steps=accumulate,
        max_steps=STEPS, learning_rate=1e-2, lr_scheduler_type="constant", optim="adamw_torch", save_strategy="no",
        report_to=[], disable_tqdm=True, seed=0, dataloader_num_workers=0, logging_steps=1,
        **({"gradient_checkpointing": True} if checkpointing else {}),  # the name transformers 5.17 knows
        **(fsdp if fsdp2 else {"ddp_backend": "gloo"} if shared_gpu else {}),
    )  # fmt: skip
    trainer = PackgraphTrainer(
        model=tiny_model("llama").train(), args=args, train_dataset=_rows(), total_tokens=TOTAL, buckets=POLICY,
        graphs=graphs, capture_options={"num_warmup_iters": 1},
    )  # fmt: skip
    with use_recorder(OpReplayRecorder()) if graphs and on_cpu else contextlib.nullcontext():
        trainer.train()
    if graphs:
        assert trainer.packgraph_layers is not None and trainer.packgraph_layers.graphed
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    model = trainer.accelerator.unwrap_model(trainer.model)
    if fsdp2:  # accelerate sharded the model: its parameters are DTensors
        assert all(type(p).__name__ == "DTensor" for p in model.parameters()), "FSDP2 was not applied"
    params = {n: getattr(p, "full_tensor", p.detach)().detach().clone() for n, p in model.named_parameters()}
    return losses, params


def _rank(rank: int, world: int, port: int, out: str, graphs: bool, checkpointing: bool, device: str = "cpu") -> None:
    torch.set_num_threads(1)
    # On CUDA every rank is told it is its node's only process, so that each takes cuda:0, the one GPU they share.
    local = (rank, world) if device == "cpu" else (0, 1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(local[0]), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(local[1]),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    losses, params = _train(
        Path(out) / f"rank{rank}", graphs=graphs, accumulate=1, checkpointing=checkpointing, device=device
    )
    torch.save({"losses": losses, "params": params}, Path(out) / f"rank{rank}.pt")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "world,graphs,checkpointing", [(2, False, False), (2, True, False), (2, True, True), (4, True, False)]
)
def test_ranks_equal_one_process_accumulating_their_batches(tmp_path, world, graphs, checkpointing):
    """With ``gradient_checkpointing=True`` each graphed layer recomputes inside its backward graph."""
    assert len(_rows()) >= world * STEPS  # no epoch ends within the run: the samplers of both runs stay in step
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _rank, args=(world, _free_port(), str(tmp_path), graphs, checkpointing), nprocs=world, start_method=method
    )
    want_losses, want_params = _train(tmp_path / "one", graphs=False, accumulate=world)
    assert len(want_losses) == STEPS
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
        for name, p in want_params.items():
            torch.testing.assert_close(got["params"][name], p, rtol=1e-5, atol=1e-6, msg=name)
