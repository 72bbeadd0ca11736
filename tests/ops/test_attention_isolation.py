"""Documents stay apart in the reference attention, as in FlashAttention-2: NaN/Inf planted in dead rows (tail,
padding) or in one document's rows never reaches another document's output or gradients, and dead rows still come
out as exact zeros with exact-zero gradients.

The expected values come from a float64 per-document loop written here (plain softmax attention and RoPE with
positions ``arange(len)``), independent of the library.
"""

import math
import random

import pytest
import torch

from packgraph import PackedSeqParams
from packgraph.ops import apply_rope_thd, varlen_attention, varlen_attention_reference

F64 = torch.float64
POISONS = (float("nan"), float("inf"), float("-inf"))


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------ per-document loop
def rope(x, base=10000.0):
    """Rotate-half RoPE of one document ``[len, H, D]`` at positions ``arange(len)``."""
    n, _, d = x.shape
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=F64) / d)
    angles = torch.arange(n, dtype=F64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    first, second = x.chunk(2, dim=-1)
    return x * angles.cos() + torch.cat([-second, first], dim=-1) * angles.sin()


def attend(q, k, v, causal, scale):
    """softmax(q k^T * scale) v for one document, bottom-right causal; a query that sees no key outputs 0."""
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    visible = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        visible = visible.tril(diagonal=lk - lq)
    sees_any = visible.any(dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~visible, -math.inf).masked_fill(~sees_any[:, None], 0.0)
    probs = torch.softmax(scores, dim=-1) * sees_any[:, None]
    return torch.einsum("hqk,khd->qhd", probs, v)


def segments(params, which):
    """[(first_row, length)] per slot, from the host."""
    cu = getattr(params, f"cu_seqlens_{which}").tolist()
    padded = getattr(params, f"cu_seqlens_{which}_padded")
    starts = padded.tolist() if padded is not None else cu
    return [(starts[i], cu[i + 1] - cu[i]) for i in range(len(cu) - 1)]


def live_rows(params, which, n_rows):
    live = torch.zeros(n_rows, dtype=torch.bool)
    for start, length in segments(params, which):
        live[start : start + length] = True
    return live


def document_grads(q, k, v, dout, causal, scale, with_rope):
    """Output and (dq, dk, dv) of one document, by autograd in float64."""
    leaves = [x.detach().to(F64).requires_grad_() for x in (q, k, v)]
    qd, kd, vd = leaves
    if with_rope:
        qd, kd = rope(qd), rope(kd)
    out = attend(qd, kd, vd, causal, scale)
    if out.numel() == 0 or not out.requires_grad:
        return out.detach(), [torch.zeros_like(x) for x in leaves]
    grads = torch.autograd.grad(out, leaves, dout.to(F64), allow_unused=True)
    return out.detach(), [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads, strict=True)]


# ------------------------------------------------------------------------------------------------ helpers
def kv_side(params):
    """Params whose q side is ``params``' kv side: RoPE of k restarts at the kv layout's offsets."""
    return PackedSeqParams(
        cu_seqlens_q=params.cu_seqlens_kv,
        cu_seqlens_kv=params.cu_seqlens_kv,
        cu_seqlens_q_padded=params.cu_seqlens_kv_padded,
        cu_seqlens_kv_padded=params.cu_seqlens_kv_padded,
    )


def library_grads(q, k, v, dout, params, *, causal, scale, with_rope, fn=varlen_attention):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    qr, kr, vr = leaves
    if with_rope:
        qr, kr = apply_rope_thd(qr, params), apply_rope_thd(kr, kv_side(params))
    out = fn(qr, kr, vr, params, causal=causal, softmax_scale=scale)
    return out.detach(), list(torch.autograd.grad(out, leaves, dout))


def plant(x, rows, rng, *, every=False):
    """Write NaN/+Inf/-Inf into ``rows`` of ``x`` (in place): into every element when ``every``, else into one
    random element of one random row."""
    if not rows:
        return
    if every:
        for r in rows:
            x[r] = rng.choice(POISONS)
    else:
        x[rng.choice(rows), rng.randrange(x.shape[1]), rng.randrange(x.shape[2])] = rng.choice(POISONS)


def rows_of(segs, docs):
    return [r for i in docs for r in range(segs[i][0], segs[i][0] + segs[i][1])]


def assert_isolated(params, q, k, v, dout, poisoned, *, causal, scale, with_rope, atol, rtol, what):
    """Through the library: every document outside ``poisoned`` gets the per-document loop's output and grads;
    dead rows get exact zeros in the output and in every grad."""
    out, (dq, dk, dv) = library_grads(q, k, v, dout, params, causal=causal, scale=scale, with_rope=with_rope)
    scale_ = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    segs_q, segs_k = segments(params, "q"), segments(params, "kv")
    for i, ((qs, lq), (ks, lk)) in enumerate(zip(segs_q, segs_k, strict=True)):
        if i in poisoned:
            continue
        rq, rk = slice(qs, qs + lq), slice(ks, ks + lk)
        want, (wq, wk, wv) = document_grads(q[rq], k[rk], v[rk], dout[rq], causal, scale_, with_rope)
        for name, got, exp in (("out", out[rq], want), ("dq", dq[rq], wq), ("dk", dk[rk], wk), ("dv", dv[rk], wv)):
            torch.testing.assert_close(
                got.to(F64),
                exp,
                atol=atol,
                rtol=rtol,
                msg=lambda m, i=i, name=name: f"{what} {params} doc {i} {name}: {m}",
            )
    for name, got, which in (("out", out, "q"), ("dq", dq, "q"), ("dk", dk, "kv"), ("dv", dv, "kv")):
        dead = got[~live_rows(params, which, got.shape[0])]
        assert torch.equal(dead, torch.zeros_like(dead)), f"{what} {params}: dead rows of {name} must be exact zeros"
    return out, (dq, dk, dv)


# ------------------------------------------------------------------------------------------------ fixed case
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_non_finite_rows_stay_in_their_document(causal, dtype):
    # Lengths 5, 3, 0, 4 padded to 4, two ghost slots and a tail: rows 5-7, 11, 16-23 are dead.
    params = PackedSeqParams.from_seqlens([5, 3, 0, 4], capacity=6, total_tokens=24, pad_to_multiple=4)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(24, h, 8, generator=g, dtype=F64) for h in (4, 2, 2))
    dout = torch.randn(24, 4, 8, generator=g, dtype=F64)
    dead = (~live_rows(params, "q", 24)).nonzero().flatten().tolist()
    bad = {name: x.clone() for name, x in zip(("q", "k", "v", "dout"), (q, k, v, dout), strict=True)}
    for i, name in enumerate(bad):  # every dead row of q, k, v and the upstream grad, NaN or +-Inf
        bad[name][dead] = POISONS[i % 3]
    # Document 1 (rows 8-10): NaN in v, Inf in q, -Inf in k, NaN in its upstream grad.
    bad["v"][9, 1, 3], bad["q"][10, 0, 0], bad["k"][8, 1, 5], bad["dout"][8, 2, 2] = POISONS + (math.nan,)
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == F64 else dict(atol=1e-5, rtol=1e-5)
    cast = [x.to(dtype) for x in (q, k, v, dout)]
    clean_out, clean_grads = library_grads(*cast, params, causal=causal, scale=None, with_rope=False)
    out, grads = library_grads(*(bad[n].to(dtype) for n in bad), params, causal=causal, scale=None, with_rope=False)

    other = [r for r in range(24) if r not in dead and r not in (8, 9, 10)]  # documents 0 and 3
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (clean_out, *clean_grads), strict=True):
        assert torch.isfinite(got[other]).all(), f"{name}: NaN/Inf reached another document"
        torch.testing.assert_close(
            got[other], want[other], atol=0, rtol=0, msg=lambda m, name=name: f"{name} vs clean: {m}"
        )
        assert torch.equal(got[dead], torch.zeros_like(got[dead])), f"{name}: dead rows must be exact zeros"
    if dtype != torch.bfloat16:  # and the clean documents are right, not just equal to a clean run
        assert_isolated(
            params,
            *(bad[n].to(dtype) for n in bad),
            {1},
            causal=causal,
            scale=None,
            with_rope=True,
            **tol,
            what="against the loop",
        )


def test_non_finite_value_spreads_only_along_visible_pairs():
    """Within one document a NaN in key row j reaches only the queries that see j (causal: rows j and after)."""
    params = PackedSeqParams.from_seqlens([6], total_tokens=8)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(8, 2, 4, generator=g, dtype=F64) for _ in range(3))
    dout = torch.randn(8, 2, 4, generator=g, dtype=F64)
    clean_out, clean_grads = library_grads(q, k, v, dout, params, causal=True, scale=None, with_rope=False)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[4, 0, 1], v_bad[4, 1, 2] = math.inf, math.nan
    out, (dq, dk, dv) = library_grads(q, k_bad, v_bad, dout, params, causal=True, scale=None, with_rope=False)
    torch.testing.assert_close(out[:4], clean_out[:4], atol=0, rtol=0)  # queries 0-3 do not see key 4
    torch.testing.assert_close(dq[:4], clean_grads[0][:4], atol=0, rtol=0)
    assert out[4:6].isnan().any(dim=2).any(dim=1).all(), "queries 4 and 5 see the poisoned key"
    for name, got in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.equal(got[6:], torch.zeros_like(got[6:])), f"{name}: dead rows must be exact zeros"


def test_frozen_inputs_get_no_grad():
    params = PackedSeqParams.from_seqlens([3, 4], capacity=3, total_tokens=9)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(9, 2, 4, generator=g, dtype=F64) for _ in range(3))
    dout = torch.randn(9, 2, 4, generator=g, dtype=F64)
    _, (want_dq, _, want_dv) = library_grads(q, k, v, dout, params, causal=True, scale=None, with_rope=False)
    leaves = [q.clone().requires_grad_(), k, v.clone().requires_grad_()]
    out = varlen_attention_reference(*leaves, params)
    out.backward(dout)
    assert k.grad is None
    torch.testing.assert_close(leaves[0].grad, want_dq, atol=0, rtol=0)
    torch.testing.assert_close(leaves[2].grad, want_dv, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------ fuzz
def offsets(lengths, ghost_slots, pad):
    out = [0]
    for n in lengths + [0] * ghost_slots:
        out.append(out[-1] + -(-n // pad) * pad)
    return out


def random_packing(rng):
    """Self-attention params (from_seqlens, shared q/kv offsets) or cross-attention shapes (own kv offsets)."""
    capacity = rng.randint(1, 6)
    lengths = [rng.choice([0, 1, rng.randint(1, 10)]) for _ in range(rng.randint(0, capacity))]
    pad = rng.choice([1, 1, 2, 4])
    cross = rng.random() < 0.25
    tail = rng.randint(0, 4)
    if not cross:
        used = offsets(lengths, 0, pad)[-1]
        params = PackedSeqParams.from_seqlens(lengths, capacity=capacity, total_tokens=used + tail, pad_to_multiple=pad)
        return params, params.total_tokens, params.total_tokens
    lengths_kv = [rng.choice([0, 1, rng.randint(1, 10)]) for _ in lengths]
    ghosts = capacity - len(lengths)
    sides = {}
    for which, ls in (("q", lengths), ("kv", lengths_kv)):
        sides[f"cu_seqlens_{which}"] = torch.tensor(offsets(ls, ghosts, 1), dtype=torch.int32)
        if pad > 1:
            sides[f"cu_seqlens_{which}_padded"] = torch.tensor(offsets(ls, ghosts, pad), dtype=torch.int32)
    rows_q = offsets(lengths, ghosts, pad)[-1] + tail
    rows_k = offsets(lengths_kv, ghosts, pad)[-1] + rng.randint(0, 4)
    return PackedSeqParams(**sides), rows_q, rows_k


def test_fuzz_isolation_against_per_document_loop():
    """1,000 random packings through apply_rope_thd and varlen_attention (the CPU reference), NaN/Inf planted in
    dead rows and in some documents (q, k, v or the upstream grad): every other document matches the float64
    per-document loop, output and grads, and dead rows are exact zeros."""
    rng = random.Random(31)
    for trial in range(1000):
        params, rows_q, rows_k = random_packing(rng)
        hq, hkv = rng.choice([(1, 1), (2, 2), (2, 1)])
        d = rng.choice([2, 4])
        causal = rng.random() < 0.7
        scale = rng.choice([None, None, 0.3])
        g = torch.Generator().manual_seed(trial)
        q = torch.randn(rows_q, hq, d, generator=g, dtype=F64)
        k, v = (torch.randn(rows_k, hkv, d, generator=g, dtype=F64) for _ in range(2))
        dout = torch.randn(rows_q, hq, d, generator=g, dtype=F64)
        segs_q, segs_k = segments(params, "q"), segments(params, "kv")
        dead_q = (~live_rows(params, "q", rows_q)).nonzero().flatten().tolist()
        dead_k = (~live_rows(params, "kv", rows_k)).nonzero().flatten().tolist()
        for x, dead in ((q, dead_q), (k, dead_k), (v, dead_k), (dout, dead_q)):
            plant(x, dead, rng, every=rng.random() < 0.5)
        poisoned = {i for i in range(len(segs_q)) if rng.random() < 0.3}
        for i in poisoned:
            x, segs = rng.choice(((q, segs_q), (k, segs_k), (v, segs_k), (dout, segs_q)))
            plant(x, rows_of(segs, [i]), rng)
        assert_isolated(
            params,
            q,
            k,
            v,
            dout,
            poisoned,
            causal=causal,
            scale=scale,
            with_rope=True,
            atol=1e-12,
            rtol=1e-10,
            what=f"trial {trial} (heads {hq}/{hkv}, causal={causal}, scale={scale})",
        )
