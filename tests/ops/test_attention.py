"""varlen_attention against a naive per-document loop in float64 (written independently of the library).

The FlashAttention path cannot run on CPU; it is exercised here through fake ``varlen_attn`` functions with the
signatures of torch 2.10 / 2.11 / 2.12+ that, like FA2, leave rows outside their segments (and past
``max_seqlen``) unwritten: NaN in the output and in dq/dk/dv, and that read ``is_causal`` / ``window_size`` as FA2
does (:func:`fa2_window`). ``fake_chunk_ops`` stands in for aten's FA2 forward and backward under
``packgraph.ops.flash_chunks``. The real kernel is tested in tests/cuda/.
"""

import math
import random

import pytest
import torch

from packgraph import PackedSeqParams
from packgraph.ops import attention as attention_mod
from packgraph.ops import varlen_attention, varlen_attention_reference
from packgraph.params import PackedSeqParamsError

F64 = torch.float64


# ------------------------------------------------------------------------------------------------ naive loop
def host_segments(params, which):
    """[(start_row, length)] per slot, from the host."""
    cu = getattr(params, f"cu_seqlens_{which}").tolist()
    padded = getattr(params, f"cu_seqlens_{which}_padded")
    starts = padded.tolist() if padded is not None else cu
    return [(starts[i], cu[i + 1] - cu[i]) for i in range(len(cu) - 1)]


def attend(qi, ki, vi, causal, scale, window=(-1, -1)):
    """softmax(q k^T * scale + mask) v for one document; q [lq, Hq, D], k/v [lk, Hkv, D]; GQA by h // group.
    ``window=(left, right)``: query i sees key j only within ``[i + shift - left, i + shift + right]`` (-1:
    unbounded)."""
    lq, hq, d = qi.shape
    lk, hkv, _ = ki.shape
    group = hq // hkv
    i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
    visible = torch.ones(lq, lk, dtype=torch.bool)
    if causal:  # bottom-right aligned, as FA2
        visible = j <= i + lk - lq
    left, right = window
    if left >= 0:
        visible = visible & (j >= i + lk - lq - left)
    if right >= 0:
        visible = visible & (j <= i + lk - lq + right)
    empty = ~visible.any(dim=1)
    heads = []
    for h in range(hq):
        s = qi[:, h] @ ki[:, h // group].T * scale
        s = s.masked_fill(~visible, float("-inf")).masked_fill(empty[:, None], 0.0)
        p = torch.softmax(s, dim=-1) * (~empty)[:, None].to(s.dtype)
        heads.append(p @ vi[:, h // group])
    return torch.stack(heads, dim=1) if heads else qi.new_zeros(lq, 0, d)


def naive_attention(q, k, v, params, causal, scale=None):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.zeros_like(q)
    for (qs, lq), (ks, lk) in zip(host_segments(params, "q"), host_segments(params, "kv"), strict=True):
        if lq:
            out[qs : qs + lq] = attend(q[qs : qs + lq], k[ks : ks + lk], v[ks : ks + lk], causal, scale)
    return out


def live_rows(params, which, n_rows):
    live = torch.zeros(n_rows, dtype=torch.bool)
    for start, length in host_segments(params, which):
        live[start : start + length] = True
    return live


def qkv(t, hq, hkv, d, *, seed=0, dtype=F64, tk=None):
    g = torch.Generator().manual_seed(seed)
    tk = t if tk is None else tk
    q = torch.randn(t, hq, d, generator=g, dtype=F64).to(dtype)
    k = torch.randn(tk, hkv, d, generator=g, dtype=F64).to(dtype)
    v = torch.randn(tk, hkv, d, generator=g, dtype=F64).to(dtype)
    return q, k, v


# (lengths, capacity, total_tokens, pad_to_multiple)
CASES = {
    "plain": ([5, 3, 7], None, None, 1),
    "zero_length_docs": ([0, 4, 0, 3, 0], None, None, 1),
    "one_token_docs": ([1, 1, 3, 1], None, None, 1),
    "ghost_slots": ([4, 2], 6, None, 1),
    "tail_rows": ([4, 3], 4, 12, 1),
    "padded_4": ([5, 1, 0, 3], 6, 24, 4),
    "padded_8": ([5, 9, 1], 4, 40, 8),
    "all_ghosts": ([], 3, 5, 1),
}
HEADS = [(4, 4), (4, 2), (4, 1)]


def make_params(name, max_seqlen=None):
    lengths, capacity, total, pad = CASES[name]
    return PackedSeqParams.from_seqlens(
        lengths, capacity=capacity, total_tokens=total, pad_to_multiple=pad, max_seqlen=max_seqlen
    )


# ------------------------------------------------------------------------------------------------ reference path
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}_hkv{h[1]}")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_matches_loop(case, causal, heads):
    params = make_params(case)
    t = params.total_tokens
    q, k, v = qkv(t, *heads, 8, seed=len(case))
    out = varlen_attention(q, k, v, params, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, naive_attention(q, k, v, params, causal), rtol=1e-12, atol=1e-12)
    dead = ~live_rows(params, "q", t)
    assert torch.equal(out[dead], torch.zeros_like(out[dead])), "dead rows must be exact zeros"
    torch.testing.assert_close(varlen_attention_reference(q, k, v, params, causal=causal), out, rtol=0, atol=0)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}_hkv{h[1]}")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", ["zero_length_docs", "one_token_docs", "tail_rows", "padded_4", "padded_8"])
def test_gradients_match_loop(case, causal, heads):
    params = make_params(case)
    t = params.total_tokens
    base = qkv(t, *heads, 8, seed=7)
    weight = torch.randn(t, heads[0], 8, generator=torch.Generator().manual_seed(1), dtype=F64)
    grads = []
    for fn in (lambda *a: varlen_attention(*a, params, causal=causal), lambda *a: naive_attention(*a, params, causal)):
        leaves = [x.clone().requires_grad_() for x in base]
        (fn(*leaves) * weight).sum().backward()
        grads.append([x.grad for x in leaves])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    dead_q, dead_k = ~live_rows(params, "q", t), ~live_rows(params, "kv", t)
    assert torch.equal(grads[0][0][dead_q], torch.zeros_like(grads[0][0][dead_q]))
    for g in grads[0][1:]:
        assert torch.equal(g[dead_k], torch.zeros_like(g[dead_k]))


def cross_params(lengths_q, lengths_kv):
    def offsets(lengths):
        out = [0]
        for n in lengths:
            out.append(out[-1] + n)
        return torch.tensor(out, dtype=torch.int32)

    return PackedSeqParams(
        cu_seqlens_q=offsets(lengths_q),
        cu_seqlens_kv=offsets(lengths_kv),
        max_seqlen_q=max(lengths_q),
        max_seqlen_kv=max(lengths_kv),
    )


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cross_attention_shapes_bottom_right(causal):
    # q/kv lengths differ per document, including len_kv < len_q (first rows see no key under causal: 0).
    lq, lk = [3, 5, 2, 0, 4], [6, 2, 2, 3, 0]
    params = cross_params(lq, lk)
    q, k, v = qkv(sum(lq) + 2, 4, 2, 8, seed=3, tk=sum(lk) + 3)  # plus tail rows on both sides
    want = naive_attention(q, k, v, params, causal)
    torch.testing.assert_close(varlen_attention(q, k, v, params, causal=causal), want, rtol=1e-12, atol=1e-12)
    if causal:  # document 1: len_q 5, len_kv 2 -> its first 3 queries see nothing
        assert torch.equal(want[3:6], torch.zeros_like(want[3:6]))


def test_softmax_scale_and_dtypes():
    params = make_params("padded_4")
    q, k, v = qkv(params.total_tokens, 4, 2, 8, seed=5)
    torch.testing.assert_close(
        varlen_attention(q, k, v, params, softmax_scale=0.3), naive_attention(q, k, v, params, True, scale=0.3)
    )
    want = naive_attention(q, k, v, params, True)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        out = varlen_attention(q.to(dtype), k.to(dtype), v.to(dtype), params)
        assert out.dtype == dtype
        torch.testing.assert_close(out.to(F64), want, rtol=tol, atol=tol)


def random_case(rng):
    capacity = rng.randint(1, 6)
    lengths = [rng.choice([0, 1, rng.randint(1, 9)]) for _ in range(rng.randint(0, capacity))]
    pad = rng.choice([1, 1, 2, 4, 8])
    used = sum(-(-n // pad) * pad for n in lengths)
    params = PackedSeqParams.from_seqlens(
        lengths,
        capacity=capacity,
        total_tokens=max(used + rng.randint(0, 5), 1),
        pad_to_multiple=pad,
        max_seqlen=max(lengths + [1]) + rng.randint(0, 3),
    )
    heads = rng.choice([(2, 2), (4, 2), (4, 1), (3, 1), (6, 3)])
    return params, heads, rng.choice([4, 8]), rng.random() < 0.5


def test_fuzz_against_loop():
    rng = random.Random(1234)
    for trial in range(50):
        params, heads, d, causal = random_case(rng)
        t = params.total_tokens
        q, k, v = qkv(t, *heads, d, seed=trial)
        out = varlen_attention(q, k, v, params, causal=causal)
        torch.testing.assert_close(out, naive_attention(q, k, v, params, causal), rtol=1e-12, atol=1e-12)
        dead = ~live_rows(params, "q", t)
        assert torch.equal(out[dead], torch.zeros_like(out[dead])), f"trial {trial}: {params}"
        if trial % 5 == 0:
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            varlen_attention(*leaves, params, causal=causal).pow(2).sum().backward()
            ref = [x.clone().requires_grad_() for x in (q, k, v)]
            loss = naive_attention(*ref, params, causal).pow(2).sum()
            if loss.requires_grad:  # False when the packing holds no token
                loss.backward()
            for a, b in zip(leaves, ref, strict=True):
                want = b.grad if b.grad is not None else torch.zeros_like(b)
                torch.testing.assert_close(a.grad, want, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------ validation
def test_rejects_bad_inputs():
    params = make_params("plain")
    t = params.total_tokens
    q, k, v = qkv(t, 4, 2, 8)
    bad = {
        "q not 3-D": (q.reshape(t, 32), k, v),
        "k/v shapes differ": (q, k, v[:, :1]),
        "head_dim differs": (q, k[..., :4], v[..., :4]),
        "heads not a multiple": (q[:, :3], k, v),
        "dtypes differ": (q.float(), k, v),
    }
    for what, args in bad.items():
        with pytest.raises(ValueError):
            varlen_attention(*args, params)
            pytest.fail(what)
    with pytest.raises(PackedSeqParamsError, match="cu_seqlens_q"):
        varlen_attention(q, k, v, params.replace(cu_seqlens_q=params.cu_seqlens_q.long()))
    with pytest.raises(PackedSeqParamsError, match="exceeds"):
        varlen_attention(q[:10], k[:10], v[:10], params)  # host offsets say 15 rows


# ------------------------------------------------------------------------------------------------ FA2 path
def offsets_host(params, which):
    """The interleaved (real, padding) offsets, computed on the host."""
    out = []
    for start, length in host_segments(params, which):
        out += [start, start + length]
    padded = getattr(params, f"cu_seqlens_{which}_padded")
    return out + [(padded if padded is not None else getattr(params, f"cu_seqlens_{which}"))[-1].item()]


def test_flash_offsets():
    plain = make_params("ghost_slots")
    cu_q, cu_k = attention_mod.flash_offsets(plain)
    assert cu_q is plain.cu_seqlens_q and cu_k is plain.cu_seqlens_kv
    padded = make_params("padded_4")  # lengths 5, 1, 0, 3 padded to 4, two ghost slots
    cu_q, cu_k = attention_mod.flash_offsets(padded)
    assert cu_q.dtype == torch.int32 and cu_q.is_contiguous()
    assert cu_q.tolist() == offsets_host(padded, "q") == [0, 5, 8, 9, 12, 12, 12, 15, 16, 16, 16, 16, 16]
    assert cu_k.tolist() == cu_q.tolist()


class _NaNGradOutside(torch.autograd.Function):
    """Identity; the backward writes NaN into rows a fake kernel does not cover (FA2 leaves them unwritten)."""

    @staticmethod
    def forward(ctx, x, covered):
        ctx.save_for_backward(covered)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (covered,) = ctx.saved_tensors
        return torch.where(covered[:, None, None], grad, float("nan")), None


def fa2_window(is_causal, window_size, max_q, max_k):
    """The (left, right) window FA2's varlen kernel applies (flash_api.cpp, mha_varlen_fwd and _bwd): causal is
    ``right = 0`` (dropped when ``max_q == 1``, where it changes nothing), and a bound that reaches ``max_k``
    becomes -1."""
    left, right = window_size
    if max_q == 1:
        is_causal = False
    if is_causal:
        right = 0
    return (-1 if left >= max_k else left), (-1 if right >= max_k else right)


def fake_kernel(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, calls, window_size=(-1, -1), **seen):
    """FA2 semantics on CPU: segments from cu_q/cu_k; rows past a segment's first max_q (max_k) rows and rows
    in no segment are garbage (NaN) in the output and in the gradients."""
    seen = dict(seen, window_size=tuple(window_size)) if tuple(window_size) != (-1, -1) else seen
    calls.append(dict(hq=q.shape[1], hkv=k.shape[1], max_q=max_q, scale=scale, slots=cu_q.numel() - 1, **seen))
    window = fa2_window(causal, window_size, max_q, max_k)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    covered_q = torch.zeros(q.shape[0], dtype=torch.bool)
    covered_k = torch.zeros(k.shape[0], dtype=torch.bool)
    for i in range(len(cq) - 1):
        covered_q[cq[i] : min(cq[i + 1], cq[i] + max_q)] = True
        covered_k[ck[i] : min(ck[i + 1], ck[i] + max_k)] = True
    q = _NaNGradOutside.apply(q, covered_q)
    k, v = _NaNGradOutside.apply(k, covered_k), _NaNGradOutside.apply(v, covered_k)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.zeros_like(q)
    for i in range(len(cq) - 1):
        if cq[i + 1] > cq[i]:
            out[cq[i] : cq[i + 1]] = attend(
                q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]], v[ck[i] : ck[i + 1]], False, scale, window
            )
    return torch.where(covered_q[:, None, None], out, float("nan"))


def fake_apis(calls):
    def v2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        assert query.shape[1] == key.shape[1], "no enable_gqa: heads must match"
        return fake_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, None, calls)

    def v2_11(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
    ):
        assert query.shape[1] == key.shape[1], "no enable_gqa: heads must match"
        causal = window_size == (-1, 0)  # as varlen_attn sets is_causal
        return fake_kernel(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, scale, calls, window_size=window_size
        )

    def v2_12(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
    ):
        assert enable_gqa or query.shape[1] == key.shape[1]
        causal = window_size == (-1, 0)
        return fake_kernel(
            query,
            key,
            value,
            cu_seq_q,
            cu_seq_k,
            max_q,
            max_k,
            causal,
            scale,
            calls,
            window_size=window_size,
            gqa=enable_gqa,
        )

    return {"2.10": v2_10, "2.11": v2_11, "2.12": v2_12}


def fake_chunk_ops(calls):
    """Stand-ins for ``packgraph.ops.flash_chunks.flash_forward`` / ``flash_backward`` (aten's FA2 varlen forward
    and backward; GQA native): the forward is :func:`fake_kernel`'s; the backward writes the grads of the slots of
    its offsets only, recomputed in float64 from q/k/v (``out`` and ``lse`` are not used), NaN elsewhere and past
    ``max_seqlen``, as FA2 leaves those rows unwritten. ``calls`` records ``("forward" | "backward", slots,
    window)``."""

    def window_size(window):
        return (-1, -1) if window is None else tuple(window)

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window):
        calls.append(("forward", cu_q.numel() - 1, window))
        out = fake_kernel(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, [], window_size=window_size(window))
        lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)  # unused by the fake backward
        return out, lse, torch.zeros(2), torch.zeros(()), torch.zeros(0)

    def backward(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, rng, unused, scale, window):
        calls.append(("backward", cu_q.numel() - 1, window))
        win = fa2_window(causal, window_size(window), max_q, max_k)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
        cq, ck = cu_q.tolist(), cu_k.tolist()
        for i in range(len(cq) - 1):
            rq, rk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
            if cq[i + 1] == cq[i] or ck[i + 1] == ck[i]:  # no query or no key: zero grads
                for g, r in zip(grads, (rq, rk, rk), strict=True):
                    g[r] = 0.0
                continue
            leaves = [x[r].detach().requires_grad_() for x, r in ((q, rq), (k, rk), (v, rk))]
            with torch.enable_grad():
                seg = attend(*leaves, False, scale, win)
                got = torch.autograd.grad(seg, leaves, grad[rq], allow_unused=True)
            for g, x, gx, r, limit in zip(grads, leaves, got, (rq, rk, rk), (max_q, max_k, max_k), strict=True):
                part = torch.zeros_like(x) if gx is None else gx
                part[limit:] = float("nan")  # FA2 writes no row past max_seqlen of a segment
                g[r] = part
        return tuple(grads)

    return forward, backward


def test_installed_torch_varlen_signature_is_understood():
    api = attention_mod._torch_varlen_api()
    assert api is not None, f"torch {torch.__version__} should ship torch.nn.attention.varlen.varlen_attn"
    from torch.nn.attention.varlen import varlen_attn

    assert api.fn is varlen_attn
    assert api.causal_kw in ("window_size", "is_causal")
    assert attention_mod._torch_varlen_api() is api  # detected once


FAKE_CASES = {
    "tail_rows": dict(lengths=[4, 3], capacity=4, total_tokens=12),
    # padding segments (7 and 6 rows) longer than max_seqlen (2): FA2 leaves their far rows unwritten
    "long_padding": dict(lengths=[1, 2, 0], capacity=4, total_tokens=20, pad_to_multiple=8),
    "zero_length_docs": dict(lengths=[0, 4, 0, 3, 0]),
    # max_seqlen 1 under GQA: the enable_gqa path must raise the bound FA2 sees
    "one_token_docs": dict(lengths=[1, 1, 0, 1], capacity=5, total_tokens=7, pad_to_multiple=2),
}


@pytest.mark.parametrize("version", ["2.10", "2.11", "2.12"])
@pytest.mark.parametrize("case", list(FAKE_CASES))
def test_flash_path_with_fake_kernel(version, case):
    kw = dict(FAKE_CASES[case])
    params = PackedSeqParams.from_seqlens(kw.pop("lengths"), **kw)
    calls = []
    api = attention_mod._VarlenAPI.from_function(fake_apis(calls)[version])
    t = params.total_tokens
    base = qkv(t, 4, 2, 8, seed=11)
    weight = torch.randn(t, 4, 8, generator=torch.Generator().manual_seed(2), dtype=F64)
    for causal in (True, False):
        for scale in (None, 0.2):
            leaves = [x.clone().requires_grad_() for x in base]
            out = attention_mod._flash_attention(*leaves, params, causal=causal, softmax_scale=scale, api=api)
            ref = [x.clone().requires_grad_() for x in base]
            want = naive_attention(*ref, params, causal, scale=scale)
            torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)  # NaN anywhere fails here
            (out * weight).sum().backward()
            (want * weight).sum().backward()
            for a, b in zip(leaves, ref, strict=True):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    # A dead row's output is a constant zero: its incoming gradient, NaN here, must reach no grad (the output's
    # zeroing passes the gradient through unchanged, and FA2 reads no row outside its segments).
    live = attention_mod.row_layout(params, "q", t).live[:, None, None]
    poisoned = torch.where(live, weight, float("nan"))
    leaves = [x.clone().requires_grad_() for x in base]
    attention_mod._flash_attention(*leaves, params, causal=True, softmax_scale=None, api=api).backward(poisoned)
    ref = [x.clone().requires_grad_() for x in base]
    naive_attention(*ref, params, True).backward(torch.where(live, weight, 0.0))
    for a, b in zip(leaves, ref, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    gqa_native = version == "2.12"
    assert all(c["hkv"] == (2 if gqa_native else 4) for c in calls), calls
    if gqa_native:
        assert all(c["gqa"] and c["max_q"] >= 2 for c in calls)
    if version == "2.10":  # no scale argument: the scale is folded into q
        assert all(c["scale"] is None for c in calls)


def test_flash_path_needs_varlen_attn(monkeypatch):
    monkeypatch.setattr(attention_mod, "_flash_eligible", lambda q: True)
    monkeypatch.setattr(attention_mod, "_torch_varlen_api", lambda: None)
    params = make_params("plain")
    with pytest.raises(RuntimeError, match=r"torch >= 2\.10"):
        varlen_attention(*qkv(params.total_tokens, 2, 2, 8), params)


def test_context_parallel_params_are_refused_not_attended_locally():
    params = PackedSeqParams.from_seqlens([4, 4], total_tokens=8).replace(local_cp_size=2)
    q = torch.randn(8, 2, 8, dtype=torch.float64)
    with pytest.raises(PackedSeqParamsError) as e:
        varlen_attention(q, q, q, params)
    assert e.value.field == "local_cp_size" and "cp_varlen_attention" in str(e.value)
    varlen_attention(q, q, q, params.replace(local_cp_size=1))  # a CP group of one is plain attention


def test_reference_attention_under_cpu_bf16_autocast_matches_float32():
    """Under ``torch.autocast("cpu", bfloat16)`` (a bf16 Trainer on the CPU) the reference still computes in
    float32, as FlashAttention does inside, instead of failing on a bf16 einsum."""
    p = PackedSeqParams.from_seqlens([5, 7], capacity=4, total_tokens=16)
    q = torch.randn(16, 2, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = varlen_attention(q, q, q, p)
    torch.testing.assert_close(got, varlen_attention(q, q, q, p), rtol=0, atol=0)


# ------------------------------------------------------------------------------------- dead rows' zeros
class _Views(torch.overrides.TorchFunctionMode):
    """Records the dtypes that tensors are viewed as."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.view and len(args) == 2 and isinstance(args[1], torch.dtype):
            self.dtypes.append(args[1])
        return func(*args, **(kwargs or {}))


_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32, F64: torch.int64}


@pytest.mark.parametrize("dtype", list(_BITS))
@pytest.mark.parametrize(
    "make,words",
    [
        (lambda t: t, True),  # [12, 3, 8]: a row of 24 elements, whole words in every dtype
        (lambda t: t[:, :, :5].contiguous(), None),  # 15 elements a row: words in float64 only
        (lambda t: t[:, :, ::2], False),  # not contiguous
        (lambda t: t.reshape(-1)[1:97].view(12, 8), None),  # storage offset 1: words in float64 only
        (lambda t: t.requires_grad_(), False),
    ],
)
def test_dead_rows_become_exact_zeros_and_live_rows_keep_their_bits(dtype, make, words):
    """The select on 8-byte words gives torch.where's bits: +0.0 in dead rows (NaN there included), and live rows
    as they were (-0.0, infinities, NaN)."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(12, 3, 8, generator=gen, dtype=F64).to(dtype)
    base[0, 0, :3] = torch.tensor([-0.0, math.inf, math.nan], dtype=dtype)
    base[5] = math.nan
    x = make(base.clone())
    live = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 0], dtype=torch.bool)
    want = torch.where(live.view(-1, *[1] * (x.dim() - 1)), x.detach(), 0)
    with _Views() as views:
        got = attention_mod._zero_dead_rows(x, live)
    assert torch.equal(got.detach().view(_BITS[dtype]), want.view(_BITS[dtype]))
    assert got.requires_grad == x.requires_grad
    took_words = torch.int64 in views.dtypes
    assert took_words == (words if words is not None else dtype == F64)


def test_dead_row_zeros_compile_without_a_graph_break():
    """Under torch.compile the dead rows' zeros (on the output and on the grads) stay inside one Dynamo graph: a break
    there splits every compiled attention layer in two, and each half compiles apart."""

    def step(x: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        y = attention_mod._ZeroDeadRowsOut.apply(x * 2, live)
        return (attention_mod._ZeroDeadRowGrad.apply(y, live) * 3).sum()

    x = torch.randn(16, 4, 8, dtype=torch.bfloat16, requires_grad=True)
    live = torch.arange(16) % 3 > 0
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(x, live)
    assert explained.graph_break_count == 0, [b.reason.splitlines()[0] for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_compiles_without_a_graph_break_or_recompile_for_params_with_host_offsets():
    """Params that carry host offsets (``from_seqlens``, ``PackedBatch``) under torch.compile: one graph for every
    packing, no break. Checking the host copies reads the tensors' version counters (on a GPU) or values (on the CPU),
    which Dynamo breaks the graph on in every attention layer, and their values would become guards (a recompile
    per batch): the check is skipped while tracing, as for device-only params. Values as eager's."""
    from torch._dynamo.utils import counters

    T = 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, h, 16, generator=g) for h in (4, 2, 2))
    packings = [PackedSeqParams.from_seqlens(n, capacity=4, total_tokens=T) for n in ([30, 20], [10] * 3, [64])]
    assert all(p.current_host_offsets() is not None for p in packings)

    def layer(q, k, v, params):
        return varlen_attention(q, k, v, params, causal=True) * 2

    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(q, k, v, packings[0])
    assert explained.graph_break_count == 0, [b.reason.splitlines()[0] for b in explained.break_reasons]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, backend="eager")
    for params in packings:
        torch.testing.assert_close(compiled(q, k, v, params), layer(q, k, v, params))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    # eager still checks the offsets against the rows when the host knows them
    with pytest.raises(PackedSeqParamsError, match="exceeds the tensor's rows"):
        layer(q[:40], k[:40], v[:40], packings[0])
