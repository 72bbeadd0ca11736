"""GPU: the pieces of ``packgraph bench`` that only run on CUDA.

* ``packgraph-model+compile``: a ``torch.compile`` d model captured with scope ``"model"`` must give the losses
  and grads of the same compiled model run eagerly (same fused kernels, so the tolerances of the eager-vs-graphed
  GPT tests hold), across batches of several buckets, with one graph set per bucket. On the document-mask backend
  (``packgraph-docmask-model+compile``) one graph set for them all.
* ``gpu_busy_ms``: the per-step kernel count over several profiled steps must match one step's, the per-step
  kernel time must fit in a step's wall time, and a matmul's time must land in the ``gemm`` class.
* Where Dynamo breaks the compiled GPT: nowhere on FA2, once on doc_mask (where the document mask is built).
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from packgraph.bench.methods import make_method
from packgraph.buckets import default_buckets
from packgraph.models.gpt import GPT, GPTConfig
from packgraph.packing import PackedBatch
from tests.cuda.test_gpt_cuda import GRAD_RTOL, LOSS_ATOL, loss_and_grads

SRC = str(Path(__file__).resolve().parents[2] / "src")
T = 1024


@pytest.mark.parametrize("name", ["packgraph-model+compile", "packgraph-docmask-model+compile"])
def test_compiled_model_captured_with_scope_model_equals_compiled_eager(name, report):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", d_model=128, n_layer=2, n_head=4, n_kv_head=2)).cuda()
    method = make_method(name, model, default_buckets(T), torch.device("cuda"))
    policy = method.policy  # the document mask's own: one bucket of T rows
    g = torch.Generator().manual_seed(5)
    batches = []
    for lengths in ([100, 3, 700], [1000], [50] * 20, [255, 256, 1, 1], [8, 9], [600, 400]):
        docs = [torch.randint(0, 256, (n,), generator=g) for n in lengths]
        batches.append(PackedBatch.from_documents(docs, bin_size=T, capacity=len(lengths)).to("cuda"))
    buckets = {method.bucket_key(b) for b in batches}
    # the compiled model meets several static signatures on FA2, one on the document mask
    assert len(buckets) >= 3 if name == "packgraph-model+compile" else len(buckets) == 1, buckets
    worst_loss = worst_grad = 0.0
    for batch in batches:
        # the reference: the same compiled model, eager, on the same bucketed params
        params = policy.apply(batch.packed_seq_params).replace(host_offsets=None)
        bucketed = dataclasses.replace(batch, packed_seq_params=params)
        ref_loss, ref_grads = loss_and_grads(model, model, bucketed)
        for _ in range(2):  # capture (or first replay), then replay
            loss, grads = loss_and_grads(model, method.graphed, batch)
            worst_loss = max(worst_loss, float((loss - ref_loss).abs()))
            assert float((loss - ref_loss).abs()) <= LOSS_ATOL
            for name, ref in ref_grads.items():
                diff, scale = float((grads[name] - ref).abs().max()), float(ref.abs().max()) + 1e-6
                worst_grad = max(worst_grad, diff / scale)
                assert diff <= GRAD_RTOL * scale, (name, diff, scale)
    assert method.graphs() == len(buckets)
    report(f"{name} vs compiled eager: max |loss diff|", worst_loss)
    report(f"{name} vs compiled eager: max grad diff / max |grad|", worst_grad)
    report(f"{name}: graph sets / buckets", f"{method.graphs()} / {len(buckets)}")
    method.close()


_PROFILE_SCRIPT = """
import json, torch
from packgraph.bench.profiling import gpu_busy_ms
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
calls = []
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
def step(i):
    calls.append(i)
    if i == 0:
        start.record()
    for _ in range(4):
        a @ a
    if i == 3:
        end.record()
step(0)  # cuBLAS warm-up, outside the profile
calls.clear()
one, four = gpu_busy_ms(step, steps=1), gpu_busy_ms(step, steps=4)
wall = start.elapsed_time(end) / 4  # ms per step of the 4-step profile, on the GPU's clock
print(json.dumps(dict(calls=calls, one=one.busy_ms, four=four.busy_ms, steps=four.steps, by_class=four.by_class,
                      top=four.top, kernels=[one.kernels, four.kernels], wall=wall)))
"""


def test_gpu_busy_ms_is_per_step_and_classifies_gemm(report):
    # In a child process: a torch.profiler session leaves CUPTI state behind in the process that profiled, and
    # the rest of the suite captures CUDA graphs (the bench itself profiles each method after its timed steps).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", _PROFILE_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    one, four = out["one"], out["four"]
    assert out["calls"] == [0, 0, 1, 2, 3]
    assert out["steps"] == 4 and four > 0
    # One stream: the step's kernels never overlap, so their summed time fits in the step's wall time between two
    # events, however much another process slows them. Summed over the 4 steps instead of divided, it would not.
    # (No comparison of the two profiles' times: on a GPU shared with other processes, as under gpu-check
    # --jobs, the same kernels take longer in one profile than in the other.)
    assert four <= 1.05 * out["wall"], (four, out["wall"])
    assert out["by_class"].get("gemm", 0.0) >= 0.9 * four, out["by_class"]
    assert out["top"] and out["top"][0][1] <= four + 1e-9
    k1, k4 = out["kernels"]
    assert k1 == k4 >= 4 and k1 == int(k1), out["kernels"]  # per step, at least one kernel per matmul
    report(
        "gpu_busy_ms: 4 bf16 4096^3 matmuls, ms per step (1 / 4 steps; wall of the 4)",
        f"{one:.3f} / {four:.3f}; {out['wall']:.3f}",
    )


def test_compiled_gpt_on_fa2_is_one_dynamo_graph(report):
    """torch.compile of the GPT on the FA2 path gives Dynamo one graph per batch shape: a break inside attention (as
    the dead rows' select once had) splits every layer, and the ``compile``/``compile-ro`` baselines slow down."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", d_model=128, n_layer=2, n_head=4, n_kv_head=2)).cuda()
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in (100, 3, 700)]
    batch = PackedBatch.from_documents(docs, bin_size=T, capacity=8).to("cuda")
    params = default_buckets(T).apply(batch.packed_seq_params).replace(host_offsets=None)
    batch = dataclasses.replace(batch, packed_seq_params=params)
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        explained = torch._dynamo.explain(model)(batch)
    reasons = [b.reason.splitlines()[0] for b in explained.break_reasons]
    report("compiled GPT on FA2: Dynamo graphs / breaks", f"{explained.graph_count} / {explained.graph_break_count}")
    assert explained.graph_break_count == 0, reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("backend", ["flash", "doc_mask"])
def test_compiled_gpt_breaks_only_at_the_document_mask_build(backend, report):
    """The CUDA twin of tests/models/test_gpt_compiled.py: torch.compile of the GPT, on a batch whose params carry
    host offsets, with RoPE's cache empty, under autocast. On FA2 one graph. On the document mask FlexAttention is
    traced into the model's graph, which breaks only where the mask is built, as often for one layer as for three:
    a break at each attention would keep the zeroing and layout copies around the kernel from fusing, and split the
    residual stream's grads (1.8 ms a step of GPU time in the compiled medium model on the H200)."""
    import packgraph.ops.rope as rope_mod

    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in (100, 3, 700)]
    batch = PackedBatch.from_documents(docs, bin_size=T, capacity=8).to("cuda")
    assert batch.packed_seq_params.current_host_offsets() is not None
    counts = {}
    for n_layer in (1, 3):
        torch.manual_seed(0)
        cfg = GPTConfig.preset("tiny", d_model=128, n_layer=n_layer, n_head=4, n_kv_head=2, attention_backend=backend)
        model = GPT(cfg).cuda()
        rope_mod._inv_freq_cache.clear()
        torch._dynamo.reset()
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            explained = torch._dynamo.explain(model)(batch)
        reasons = [b.reason for b in explained.break_reasons]
        assert all("_compiled_mask" in reason for reason in reasons), reasons
        counts[n_layer] = (explained.graph_count, explained.graph_break_count)
    shown = ", ".join(f"{n} layers {g} / {b}" for n, (g, b) in counts.items())
    report(f"compiled GPT on {backend}, host offsets, cold RoPE cache: Dynamo graphs / breaks", shown)
    assert counts[1] == counts[3], counts
    if backend == "flash":
        assert counts[3] == (1, 0)
    else:
        assert counts[3][1] >= 1
