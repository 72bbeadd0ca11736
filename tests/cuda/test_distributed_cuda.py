"""Multi-GPU (NCCL) checks of data and context parallelism under CUDA graphs. Skipped unless >= 2 GPUs.

* CP (2 ranks): ``cp_varlen_attention`` with RoPE on global positions, eager and replayed from a raw CUDA graph
  (forward + backward captured, NCCL all-gather and reduce-scatter inside) and from ``packgraph.capture``, over
  several packings with the same static signature; outputs and q/k/v gradients against a float32 reference on
  the unsharded stream.
* DP (2 ranks): a tiny GPT with graphed layers (``GPT.graphed(scope="layer")``), loss weighted by the global
  token count, ``allreduce_gradients``; gradients against single-process eager training on the union.

Workers run in spawned processes (one GPU each) and write their figures to JSON; the test reports the worst.
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
import torch.nn.functional as F
from torch import nn

WORLD = 2
T, CAPACITY, MAX_SEQLEN = 2048, 8, 1024
HQ, HKV, D = 8, 2, 64

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < WORLD, reason=f"needs >= {WORLD} GPUs"
)

# Document lengths (each fits MAX_SEQLEN; padded to 2*CP they fit T): long docs, 1-token docs, docs shorter than
# 2*CP, an empty doc, ghost slots, a tail.
PACKINGS = [
    [1000, 3, 1, 0, 517],
    [5, 1, 2, 3, 7, 1, 1, 9],
    [1024, 1024],
    [1],
    [333, 700, 18, 2, 640],
]


# ---------------------------------------------------------------------------------------------------- helpers
def _params(lengths, device):
    from packgraph import PackedSeqParams

    return PackedSeqParams.from_seqlens(
        lengths, capacity=CAPACITY, total_tokens=T, pad_to_multiple=2 * WORLD, max_seqlen=MAX_SEQLEN, device=device
    )


def _rel_err(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _init(rank: int, world: int, tmp: str) -> torch.device:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    return torch.device("cuda", rank)


def _start(fn, tmp: str) -> None:
    mp.start_processes(_on_loop_stream, args=(WORLD, tmp, fn), nprocs=WORLD, start_method="spawn")


def _on_loop_stream(rank: int, world: int, tmp: str, fn) -> None:
    """``fn(rank, world, tmp)`` on a loop stream of this rank's GPU: chained stacks replay only on the stream they
    were recorded on (packgraph.graphs.recorder)."""
    from packgraph.graphs import loop_stream

    torch.cuda.set_device(rank)
    with loop_stream(torch.device("cuda", rank)):
        fn(rank, world, tmp)


def _results(tmp: str, name: str) -> list[dict]:
    return [json.loads(Path(tmp, f"{name}{r}.json").read_text()) for r in range(WORLD)]


class RopeCPAttention(nn.Module):
    """The captured region: RoPE on global positions, then context-parallel causal attention."""

    def forward(self, q, k, v, packed_seq_params):
        from packgraph.distributed import cp_position_ids, cp_varlen_attention
        from packgraph.ops import apply_rope_thd

        pos = cp_position_ids(packed_seq_params, q.shape[0])
        q = apply_rope_thd(q, packed_seq_params, position_ids=pos)
        k = apply_rope_thd(k, packed_seq_params, position_ids=pos)
        return cp_varlen_attention(q, k, v, packed_seq_params)


def _reference(q, k, v, dout, params):
    """float32 RoPE + attention on the whole stream, and the q/k/v gradients."""
    from packgraph.ops import apply_rope_thd, varlen_attention_reference

    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    qr, kr = apply_rope_thd(leaves[0], params), apply_rope_thd(leaves[1], params)
    out = varlen_attention_reference(qr, kr, leaves[2], params)
    out.backward(dout.float())
    return out.detach(), [t.grad for t in leaves]


def _errors(out, grads, ref_out, ref_grads, index) -> list[float]:
    """Relative errors of this rank's output and q/k/v gradients against the reference rows it holds."""
    pairs = zip([out, *grads], [ref_out, *ref_grads], strict=True)
    return [_rel_err(got, want[index]) for got, want in pairs]


def _batch_tensors(case: int, device):
    gen = torch.Generator().manual_seed(case)
    q, k, v = (torch.randn(T, h, D, generator=gen) for h in (HQ, HKV, HKV))
    dout = torch.randn(T, HQ, D, generator=gen)
    return [t.to(device, torch.bfloat16) for t in (q, k, v, dout)]


# ---------------------------------------------------------------------------------------------------- CP worker
def _cp_worker(rank: int, world: int, tmp: str) -> None:
    from packgraph.distributed import cp_shard_index, shard_thd_for_cp
    from packgraph.graphs import capture

    device = _init(rank, world, tmp)
    try:
        layer = RopeCPAttention()
        figures = {"eager": 0.0, "raw_graph": 0.0, "capture": 0.0, "graph_vs_eager": 0.0}

        def shard(case):
            params = _params(PACKINGS[case], device)
            tensors = _batch_tensors(case, device)
            (q, k, v, dout), local, _ = shard_thd_for_cp(tuple(tensors), params, rank, world)
            return params, tensors, local, [t.contiguous() for t in (q, k, v)], dout.contiguous()

        # Static buffers for the raw graph, filled from packing 0; later packings are copied in.
        _, _, local0, qkv0, dout0 = shard(0)
        static_params = local0.replace(**{n: t.clone() for n, t in local0.graph_inputs().items()})
        static_qkv = [t.clone().requires_grad_() for t in qkv0]
        static_dout = dout0.clone()

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up: creates the NCCL communicator and the FA2 workspaces before capture
                for t in static_qkv:
                    t.grad = None
                layer(*static_qkv, static_params).backward(static_dout)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for t in static_qkv:
            t.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            static_out = layer(*static_qkv, static_params)
            static_out.backward(static_dout)

        captured = None
        for case in range(len(PACKINGS)):
            params, full, local, qkv, dout = shard(case)
            index = cp_shard_index(params, rank, world)
            ref_out, ref_grads = _reference(*full, params)

            # Eager CP.
            leaves = [t.clone().requires_grad_() for t in qkv]
            out = layer(*leaves, local)
            out.backward(dout)
            eager = [out] + [t.grad for t in leaves]
            figures["eager"] = max(figures["eager"], *_errors(out, eager[1:], ref_out, ref_grads, index))

            # Raw CUDA graph replay with this packing's offsets.
            for name, t in local.graph_inputs().items():
                getattr(static_params, name).copy_(t)
            for s, t in zip(static_qkv, qkv, strict=True):
                s.detach().copy_(t)
            static_dout.copy_(dout)
            graph.replay()
            replayed = [static_out] + [t.grad for t in static_qkv]
            errs = _errors(static_out, replayed[1:], ref_out, ref_grads, index)
            figures["raw_graph"] = max(figures["raw_graph"], *errs)
            gaps = [_rel_err(a, b) for a, b in zip(replayed, eager, strict=True)]
            figures["graph_vs_eager"] = max(figures["graph_vs_eager"], *gaps)

            # packgraph.capture: the params (local_cp_size, cp_group static) are split into the signature.
            if captured is None:
                captured = capture(layer, (*[t.clone().requires_grad_() for t in qkv], local))
            leaves = [t.clone().requires_grad_() for t in qkv]
            out = captured(*leaves, local)
            out.backward(dout)
            errs = _errors(out, [t.grad for t in leaves], ref_out, ref_grads, index)
            figures["capture"] = max(figures["capture"], *errs)

        Path(tmp, f"cp{rank}.json").write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


def test_cp_attention_nccl_under_graphs_matches_unsharded_reference(report):
    with tempfile.TemporaryDirectory() as tmp:
        _start(_cp_worker, tmp)
        rows = _results(tmp, "cp")
    worst = {key: max(r[key] for r in rows) for key in rows[0]}
    for key, value in worst.items():
        report(f"CP=2 NCCL {key}: max rel err", value)
    # bf16 inputs vs a float32 reference: ~4e-3 is typical; a wrong mask or a missing chunk is O(1).
    for key in ("eager", "raw_graph", "capture"):
        assert worst[key] < 2e-2, (key, worst[key])
    assert worst["graph_vs_eager"] < 1e-3, worst["graph_vs_eager"]


# ---------------------------------------------------------------------------------------------------- DP worker
GPT_CFG = dict(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=64)
DOC_LENGTHS = [[90, 40, 20], [250], [30, 30], [120, 70, 10, 50]]


def _dp_batches():
    from packgraph.packing import PackedBatch

    gen = torch.Generator().manual_seed(0)
    out = []
    for lengths in DOC_LENGTHS:
        docs = [torch.randint(0, GPT_CFG["vocab_size"], (n,), generator=gen) for n in lengths]
        out.append(PackedBatch.from_documents(docs, bin_size=256, capacity=4, max_seqlen=256, pad_id=0))
    return out


def _dp_worker(rank: int, world: int, tmp: str) -> None:
    from packgraph.distributed import allreduce_gradients, global_token_count, shard_batches
    from packgraph.models.gpt import GPT, GPTConfig

    device = _init(rank, world, tmp)
    try:
        batches = _dp_batches()
        torch.manual_seed(0)
        model = GPT(GPTConfig(**GPT_CFG)).to(device)
        reference = GPT(GPTConfig(**GPT_CFG)).to(device)
        reference.load_state_dict(model.state_dict())
        graphed = model.graphed(scope="layer")

        mine = [b.to(device) for b in shard_batches(batches, rank, world)]
        count = global_token_count(sum(b.num_real_tokens for b in mine), device=device)
        for _ in range(2):  # twice: the second pass replays graphs captured by the first
            model.zero_grad(set_to_none=True)
            for b in mine:
                _, loss = graphed(b)
                (loss * (b.num_real_tokens / count)).backward()
            allreduce_gradients(model)

        every = [b.to(device) for b in batches]
        logits = torch.cat([reference(b.tokens, b.packed_seq_params) for b in every])
        labels = torch.cat([b.labels for b in every])
        F.cross_entropy(logits.float(), labels, ignore_index=-100).backward()
        ref = dict(reference.named_parameters())
        err = max(_rel_err(p.grad, ref[n].grad) for n, p in model.named_parameters())
        Path(tmp, f"dp{rank}.json").write_text(json.dumps({"grad": err, "captures": graphed.captures}))
    finally:
        dist.destroy_process_group()


def test_dp_nccl_graphed_layers_match_single_process_on_the_union(report):
    with tempfile.TemporaryDirectory() as tmp:
        _start(_dp_worker, tmp)
        rows = _results(tmp, "dp")
    worst = max(r["grad"] for r in rows)
    report("DP=2 NCCL graphed layers: max grad rel err vs union", worst)
    assert all(r["captures"] >= 1 for r in rows)
    assert worst < 1e-4, worst
