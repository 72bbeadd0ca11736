"""``PackgraphTrainer`` under several processes, as ``accelerate launch`` runs it, with real CUDA graphs: two ranks
share the one GPU and reduce over gloo (NCCL refuses two ranks on one device); accelerate wraps the model in torch
DDP. The steps are tests/integrations/test_hf_trainer_ddp.py's: the reference is one process accumulating the same
two batches per step, packed and eager; both ranks' logged losses and final parameters must match it (fp32, the
exact reference attention; the two runs sum the same rows in another order). With FSDP2 (``fsdp=True``) one process
runs as torchrun starts it, NCCL with world size 1, against the same steps without FSDP.
"""

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.integrations.test_hf_trainer_ddp import STEPS, _free_port, _rank, _rows, _train  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("graphs,checkpointing", [(False, False), (True, False), (True, True)])
def test_two_ranks_on_one_gpu_equal_one_process_accumulating(tmp_path, graphs, checkpointing, report):
    assert len(_rows()) >= 2 * STEPS  # no epoch ends within the run: the samplers of both runs stay in step
    args = (2, _free_port(), str(tmp_path), graphs, checkpointing, "cuda")
    mp.start_processes(_rank, args=args, nprocs=2, start_method="spawn")
    want_losses, want_params = _train(tmp_path / "one", graphs=False, accumulate=2, device="cuda")
    assert len(want_losses) == STEPS
    worst = 0.0
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want_losses), **TOL)
        for name, p in want_params.items():
            torch.testing.assert_close(got["params"][name], p, **TOL, msg=name)
            worst = max(worst, ((got["params"][name] - p).abs().max() / p.abs().max().clamp_min(1e-12)).item())
    mode = "graphed + recompute" if checkpointing else "graphed" if graphs else "eager"
    report(f"HF Trainer DDP gloo world 2 on one GPU, {mode}: worst rel param diff vs one process", f"{worst:.2e}")


def _fsdp2_run(rank: int, port: int, out: str, graphs: bool, checkpointing: bool) -> None:
    # one process as torchrun starts it, so that accelerate applies FSDP2 (it does not in a plain process)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    losses, params = _train(Path(out) / "fsdp2", graphs=graphs, accumulate=2, checkpointing=checkpointing,
                            device="cuda", fsdp2=True)  # fmt: skip
    torch.save({"losses": losses, "params": params}, Path(out) / "fsdp2.pt")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("graphs,checkpointing", [(False, False), (True, False), (True, True)])
def test_fsdp2_under_accelerate_equals_one_process_without_it(tmp_path, graphs, checkpointing, report):
    """``PackgraphTrainer`` with ``fsdp=True`` (FSDP2: each Llama decoder layer a unit, and the model) on NCCL with
    world size 1: eager, graphed (the layers captured as units) and graphed with recomputation, against the same
    steps without FSDP."""
    mp.start_processes(
        _fsdp2_run, args=(_free_port(), str(tmp_path), graphs, checkpointing), nprocs=1, start_method="spawn"
    )
    want_losses, want_params = _train(tmp_path / "one", graphs=False, accumulate=2, device="cuda")
    got = torch.load(tmp_path / "fsdp2.pt")
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want_losses), **TOL)
    worst = 0.0
    for name, p in want_params.items():
        torch.testing.assert_close(got["params"][name], p, **TOL, msg=name)
        worst = max(worst, ((got["params"][name] - p).abs().max() / p.abs().max().clamp_min(1e-12)).item())
    mode = "graphed + recompute" if checkpointing else "graphed" if graphs else "eager"
    report(f"HF Trainer FSDP2 nccl world 1, {mode}: worst rel param diff vs one process", f"{worst:.2e}")
