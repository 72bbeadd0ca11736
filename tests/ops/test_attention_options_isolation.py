"""Documents stay apart with varlen_attention's options too (``window``, ``softcap``, ``sinks``): NaN/Inf planted in
dead rows (tail, padding) or in one document's rows (q, k, v or the upstream grad) never reaches another document's
output or grads, and dead rows come out as exact zeros with exact-zero grads.

The sinks are shared by every document, like a weight: their grad sums over all live rows, so a poisoned document
reaches it, but poisoned dead rows never do. Expected values: the float64 per-document loop of
tests/ops/test_attention_options.py.
"""

import random

import pytest
import torch

from packgraph.ops import varlen_attention
from tests.ops.test_attention_isolation import live_rows, plant, random_packing, rows_of, segments
from tests.ops.test_attention_options import COMBOS, document_attention, random_options

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


def document_grads(q, k, v, dout, sinks, *, causal, scale, options):
    """Output and grads (q, k, v, and sinks when given) of one document, by autograd in float64."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    sink_leaf = None if sinks is None else sinks.detach().clone().requires_grad_()
    wanted = leaves + ([] if sink_leaf is None else [sink_leaf])
    if q.shape[0] == 0:
        return q.new_zeros(q.shape), [torch.zeros_like(x) for x in wanted]
    out = document_attention(*leaves, causal=causal, scale=scale, sinks=sink_leaf, **options)
    grads = torch.autograd.grad(out, wanted, dout, allow_unused=True)
    return out.detach(), [torch.zeros_like(x) if g is None else g for x, g in zip(wanted, grads, strict=True)]


@pytest.mark.parametrize("combo", COMBOS)
def test_options_keep_documents_apart(combo):
    rng = random.Random(f"isolation-{combo}")
    for trial in range(150):
        params, rows_q, rows_k = random_packing(rng)
        hq, hkv = rng.choice([(1, 1), (2, 2), (2, 1), (4, 2)])
        d = rng.choice([2, 4])
        causal, options = random_options(rng, combo, hq)
        sinks = options.pop("sinks", None)
        scale = rng.choice([None, 0.3])
        g = torch.Generator().manual_seed(trial)
        q = torch.randn(rows_q, hq, d, generator=g, dtype=F64)
        k, v = (torch.randn(rows_k, hkv, d, generator=g, dtype=F64) for _ in range(2))
        dout = torch.randn(rows_q, hq, d, generator=g, dtype=F64)
        segs_q, segs_k = segments(params, "q"), segments(params, "kv")
        live_q, live_k = live_rows(params, "q", rows_q), live_rows(params, "kv", rows_k)
        for x, live in ((q, live_q), (k, live_k), (v, live_k), (dout, live_q)):
            plant(x, (~live).nonzero().flatten().tolist(), rng, every=rng.random() < 0.5)
        poisoned = {i for i in range(len(segs_q)) if rng.random() < 0.3}
        for i in poisoned:
            x, segs = rng.choice(((q, segs_q), (k, segs_k), (v, segs_k), (dout, segs_q)))
            plant(x, rows_of(segs, [i]), rng)
        what = f"trial {trial} {params} heads {hq}/{hkv} causal={causal} {options} sinks={sinks is not None}"

        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        sink_leaf = None if sinks is None else sinks.clone().requires_grad_()
        wanted = leaves + ([] if sink_leaf is None else [sink_leaf])
        out = varlen_attention(*leaves, params, causal=causal, softmax_scale=scale, sinks=sink_leaf, **options)
        if out.requires_grad:
            grads = torch.autograd.grad(out, wanted, dout, allow_unused=True)
            grads = [torch.zeros_like(x) if g is None else g for x, g in zip(wanted, grads, strict=True)]
        else:  # no live row
            grads = [torch.zeros_like(x) for x in wanted]
        out = out.detach()

        scale_ = q.shape[-1] ** -0.5 if scale is None else scale
        dsinks = torch.zeros(hq, dtype=F64)
        for i, ((qs, lq), (ks, lk)) in enumerate(zip(segs_q, segs_k, strict=True)):
            if i in poisoned:
                continue
            rq, rk = slice(qs, qs + lq), slice(ks, ks + lk)
            want, want_grads = document_grads(
                q[rq], k[rk], v[rk], dout[rq], sinks, causal=causal, scale=scale_, options=options
            )
            for name, got, exp in zip(
                ("out", "dq", "dk", "dv"),
                (out[rq], grads[0][rq], grads[1][rk], grads[2][rk]),
                (want, *want_grads[:3]),
                strict=True,
            ):
                torch.testing.assert_close(
                    got, exp, rtol=1e-10, atol=1e-12, msg=lambda m, w=what, i=i, name=name: f"{w} doc {i} {name}: {m}"
                )
            if sinks is not None:
                dsinks += want_grads[3]
        for name, got, live in zip(
            ("out", "dq", "dk", "dv"), (out, *grads[:3]), (live_q, live_q, live_k, live_k), strict=True
        ):
            dead = got[~live]
            assert torch.equal(dead, torch.zeros_like(dead)), f"{what}: dead rows of {name} must be exact zeros"
        if sinks is not None and not poisoned:  # poisoned dead rows give the shared sinks nothing
            torch.testing.assert_close(
                grads[3], dsinks, rtol=1e-10, atol=1e-12, msg=lambda m, w=what: f"{w} dsinks: {m}"
            )
