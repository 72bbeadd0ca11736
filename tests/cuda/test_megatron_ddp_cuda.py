"""Megatron-Core's ``DistributedDataParallel`` over layers graphed by ``graph_transformer_layers``, with real CUDA
graphs on one GPU: NCCL with world size 1. Two ranks cannot share the GPU here: NCCL refuses two ranks on one
device, and Megatron's DDP reduces with coalesced all-reduces, which gloo has no CUDA path for (it raises
"ProcessGroupGloo::allreduce_coalesced: unsupported device type cuda" in the eager run already). The CPU tests run
2 and 4 ranks.

The CPU tests (tests/integrations/megatron/test_megatron_ddp.py) run the same steps on the stand-in recorders, and
this module reuses them: a tiny fp32 Megatron ``GPTModel`` (packgraph's layer spec) inside Megatron's DDP, two
micro-batches per step (the first under ``no_sync()``) adding into ``main_grad``, ``finish_grad_sync``, SGD on
``main_grad``. After every step each rank's parameters and reduced grads are compared with the same rank's eager
model inside the same DDP, and with one process trained eagerly without DDP on the union of the step's batches. On
CUDA the float32 attention runs packgraph's exact reference (FlashAttention takes half types only), so float32
rounding is the only difference. ``overlap-buckets`` launches eight bucket reductions from DDP's hooks during the
backward, which the graphed layers' ``AccumulateGrad`` nodes fire as eager ones do. With full recomputation, eager
Megatron re-runs each layer in its backward through its checkpoint, and each graphed layer's backward graph
recomputes it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("megatron.core")

MICRO = 2
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
# (name, Megatron DDP setup, model config): Megatron's full recomputation against the graphs' own, in the last
CASES = [("sync", "sync", {}), ("overlap-buckets", "overlap-buckets", {}),
         ("overlap-buckets+full-recompute", "overlap-buckets", FULL_RECOMPUTE)]  # fmt: skip
TOL = 1e-4  # of each tensor's largest magnitude: the ranks' sums and the union's backward round differently


def _worst(got: list[dict], want: list[dict], where: str) -> float:
    """Assert every tensor of every step within ``TOL`` (relative to its scale); the worst relative difference."""
    worst = 0.0
    for s, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys(), where
        for name in g:
            scale = w[name].abs().max().clamp_min(1e-12)
            err = ((g[name] - w[name]).abs().max() / scale).item()
            assert err <= TOL, f"{where}: step {s}, {name}: relative difference {err:.2e} > {TOL}"
            worst = max(worst, err)
    return worst


def _worker(rank: int, world: int, backend: str, init: str, out: str) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from packgraph import default_buckets
    from packgraph.graphs import loop_stream
    from packgraph.integrations.megatron import graph_transformer_layers
    from tests.integrations.megatron import test_megatron_ddp as cpu

    torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    figures: dict[str, float | bool] = {}
    try:
        # one stream for the whole loop: a chained stack replays only on the stream it was recorded on
        with loop_stream("cuda:0"):
            batches = cpu._batches(world, MICRO)
            want = cpu._reference(batches, world, MICRO, "cuda")
            for name, ddp_name, config in CASES:
                case = dict(ddp=cpu.DDP_CONFIGS[ddp_name], micro=MICRO, normalise="loss", device="cuda")
                eager, eager_launched = cpu._train(
                    cpu._ddp(cpu._model("cuda", **config), case["ddp"]), batches, rank, world, case
                )
                model = cpu._model("cuda", **config)
                params = batches[0].to("cuda").packed_seq_params
                handle = graph_transformer_layers(model, params, scope="layer", buckets=default_buckets(cpu.T))
                ddp = cpu._ddp(model, case["ddp"])
                graphed, launched = cpu._train(ddp, batches, rank, world, case)
                assert handle.num_signatures == 2, name
                assert launched == eager_launched, (
                    f"{name}: bucket reductions launched {launched}, eagerly {eager_launched}"
                )
                figures[f"{name} vs eager in DDP"] = _worst(graphed, eager, f"rank {rank} {name} vs eager")
                figures[f"{name} vs union"] = _worst(graphed, want, f"rank {rank} {name} vs union")
                figures[f"{name} bitwise"] = all(
                    torch.equal(g[n], e[n]) for g, e in zip(graphed, eager, strict=True) for n in g
                )
                del ddp, handle, model
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(figures))
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.parametrize("backend,world", [("nccl", 1)])
def test_megatron_ddp_over_graphed_layers_equals_eager_and_the_union(backend, world, report):
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker, args=(world, backend, os.path.join(tmp, "init"), tmp), nprocs=world, start_method="spawn"
        )
        figures = json.loads(Path(tmp, "rank0.json").read_text())
    assert len(figures) == 3 * len(CASES), figures  # every case ran on rank 0
    for name, value in figures.items():
        shown = value if isinstance(value, bool) else f"{value:.2e}"
        report(f"Megatron DDP {backend} world {world}, {name}", shown)
