"""The training loop under data parallelism, in-process on gloo ranks: each rank joins through the torchrun
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``), as ``packgraph train --nproc N`` does.

Two ranks, eager and graphed (the engine on the op-replay stand-in, which replays the recorded aten ops and no
Python), with torch DDP (the default engine) and the explicit all-reduce, each equal to one process accumulating
the same micro-batches per step (``grad_accum=2``): same losses and gradient norms at every step.
"""

import contextlib
import json
import os
import socket
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from packgraph.graphs import use_recorder
from packgraph.train import train
from tests.eager_recorder import OpReplayRecorder
from tests.train.tiny import tiny_cfg

STEPS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, out: str, case: dict) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    cfg = tiny_cfg(Path(out), "dp", steps=STEPS, save_checkpoint=False, **case)
    if case.get("graphs"):
        with use_recorder(OpReplayRecorder()):
            train(cfg, echo=None)
    else:
        train(cfg, echo=None)


def _log(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "train.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("graphs,scope", [(False, "layer"), (True, "layer"), (True, "attn"), (True, "model")])
@pytest.mark.parametrize("engine", ["ddp", "allreduce"])
def test_two_ranks_equal_one_process_accumulating_their_micro_batches(tmp_path, graphs, scope, engine):
    case = dict(graphs=graphs, scope=scope, dp_engine=engine)
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(_rank, args=(2, _free_port(), str(tmp_path), case), nprocs=2, start_method=method)
    with use_recorder(OpReplayRecorder()) if graphs else contextlib.nullcontext():
        one = train(tiny_cfg(tmp_path, "one", steps=STEPS, save_checkpoint=False, grad_accum=2, graphs=graphs,
                             scope=scope), echo=None)  # fmt: skip
    dp, ref = _log(tmp_path / "dp"), _log(one.log_path.parent)
    assert [r["step"] for r in dp] == list(range(1, STEPS + 1))
    for a, b in zip(dp, ref, strict=True):
        assert a["tokens"] == b["tokens"] and a["buckets"] == b["buckets"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
