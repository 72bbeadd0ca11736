"""Document-mask attention at the attention benchmark's shapes (``packgraph bench --backends``: 16 query heads over
8, head sizes 64 and 128, T = 4096 and 8192, every mix) on CUDA, both backends against float64 (issue #36).

Apart from tests/cuda/test_doc_mask_cuda.py because it is the longest file of the GPU suite (a float64 reference per
packing, and a compilation per shape): ``scripts/gpu-check --jobs`` runs files in parallel, not tests.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from tests.cuda.test_doc_mask_cuda import TOL, _errors


def _float64_on_gpu(q, k, v, params, weight):
    """Output and grads of ``(out.float() * weight).sum()`` by the reference attention in float64 on the GPU, one kv
    head (and its query heads) at a time: the reference holds O(heads * T^2) scores."""
    from packgraph.ops import varlen_attention_reference

    group = q.shape[1] // k.shape[1]
    outs, grads = [], []
    for head in range(k.shape[1]):
        queries = slice(head * group, (head + 1) * group)
        leaves = [
            x.detach().double().requires_grad_() for x in (q[:, queries], k[:, head : head + 1], v[:, head : head + 1])
        ]
        out = varlen_attention_reference(*leaves, params)
        grads.append(torch.autograd.grad((out * weight[:, queries].double()).sum(), leaves))
        outs.append(out.detach())
    dq = torch.cat([g[0] for g in grads], dim=1)
    dk, dv = (torch.cat([g[i] for g in grads], dim=1) for i in (1, 2))
    return torch.cat(outs, dim=1), (dq, dk, dv)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_benchmark_shapes_compile_once_and_match_float64(head_dim, report):
    """The shapes of ``packgraph bench --backends`` (16 query heads over 8, T = 4096 and 8192), forward under
    ``no_grad`` and forward+backward, through ``varlen_attention`` on both backends, against the float64 reference
    on the same bf16 inputs. On torch 2.11 compiling the whole call failed there ("convert FlexibleLayout to
    FixedLayout first"). Over the packings of one T nothing compiles again after the first.

    Against float64, not against each other: in the tour's packing of 513 one-token documents the true ``dq`` and
    ``dk`` are exact zeros, and both kernels return rounding noise there, which differs by 10% between them."""
    from packgraph.bench.data import batch_stream
    from packgraph.buckets import default_buckets, document_mask_buckets
    from packgraph.ops import varlen_attention
    from packgraph.params import PackedSeqParams

    errors = {"doc_mask": [], "flash": []}
    for total in (4096, 8192):
        gen = torch.Generator(device="cuda").manual_seed(total)
        q, k, v = (
            torch.randn(total, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (16, 8, 8)
        )
        weight = torch.randn(total, 16, head_dim, device="cuda", generator=gen)
        compiles = None
        for mix in ("corpus", "short", "long", "buckets"):
            for index, batch in enumerate(batch_stream(mix, total, 2, seed=7)):
                lengths = list(batch.doc_lengths)
                raw = PackedSeqParams.from_seqlens(lengths, total_tokens=total, max_seqlen=total, device="cuda")
                want_out, want_grads = _float64_on_gpu(q, k, v, raw, weight)
                where = f"T={total} {mix} #{index} ({len(lengths)} docs)"
                for backend, policy in (("doc_mask", document_mask_buckets), ("flash", default_buckets)):
                    params = policy(total).apply(raw)
                    with torch.no_grad():
                        forward = varlen_attention(q, k, v, params, backend=backend)
                    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
                    out = varlen_attention(*leaves, params, backend=backend)
                    grads = torch.autograd.grad((out.float() * weight).sum(), leaves)
                    if backend == "doc_mask" and compiles is None:
                        compiles = counters["stats"]["unique_graphs"]  # after the first packing's compiles
                    errors[backend] += _errors((out, *grads), (want_out, *want_grads), where)
                    errors[backend] += _errors((forward,), (want_out,), f"{where} no_grad")
        assert counters["stats"]["unique_graphs"] == compiles, f"T={total}: a later packing compiled again"
    for backend, errs in errors.items():
        worst, where = max(errs)
        report(f"{backend} vs float64, bench shapes D={head_dim}: worst err ({where})", f"{worst:.2e}")
    for backend, errs in errors.items():
        assert max(errs)[0] <= TOL, (backend, sorted(errs, reverse=True)[:6])
