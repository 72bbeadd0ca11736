"""varlen_attention's options (``window``, ``softcap``, ``sinks``) against a naive per-document loop in float64,
written here independently of the library: explicit masks from the documented rule, plain softmax with a sink
column.

Every path that takes an option is compared with the loop, outputs and grads (q, k, v, sinks), on packings with
zero-length documents, ghost slots, padding and tail rows (dead rows), GQA and cross-attention shapes: the reference
(the CPU path), and FlashAttention-2 through the fake kernels of tests/ops/test_attention.py (one call, the
slot-chunked backward, short_docs), which read ``window_size`` as FA2 does. Isolation under NaN/Inf for the options
is in tests/ops/test_attention_options_isolation.py; the real kernels in tests/cuda/.
"""

import math
import random

import pytest
import torch

from packgraph import PackedSeqParams
from packgraph.ops import attention as attention_mod
from packgraph.ops import flash_chunks, short_docs, varlen_attention, varlen_attention_reference
from tests.ops.test_attention import fake_apis, fake_chunk_ops
from tests.ops.test_attention_isolation import live_rows, random_packing, segments

F64 = torch.float64


# ------------------------------------------------------------------------------------------------ naive loop
def document_attention(q, k, v, *, causal, scale, window=None, softcap=None, sinks=None):
    """One document: q ``[lq, Hq, D]``, k/v ``[lk, Hkv, D]``, differentiable in q, k, v and sinks.

    Query i sees key j iff ``j <= i + shift`` (causal) and ``i + shift - left <= j <= i + shift + right``
    (window, -1: unbounded), ``shift = lk - lq``. Scores ``q.k * scale``, then ``softcap * tanh(s / softcap)``;
    the softmax runs over the visible keys plus the head's sink (no value). A query that sees no key outputs 0.
    """
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    group = hq // hkv
    i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
    diag = i + (lk - lq)
    visible = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        visible &= j <= diag
    if window is not None:
        left, right = window
        if left >= 0:
            visible &= j >= diag - left
        if right >= 0:
            visible &= j <= diag + right
    sees_any = visible.any(dim=1)
    heads = []
    for h in range(hq):
        s = q[:, h] @ k[:, h // group].T * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~visible, -math.inf)
        if sinks is not None:
            p = torch.softmax(torch.cat([s, sinks[h].expand(lq, 1)], dim=1), dim=1)[:, :lk]
        else:
            p = torch.softmax(s.masked_fill(~sees_any[:, None], 0.0), dim=1)
        heads.append((p * sees_any[:, None]) @ v[:, h // group])
    return torch.stack(heads, dim=1)


def naive(q, k, v, params, *, causal, softmax_scale=None, **options):
    """The whole stream: each document by :func:`document_attention`, dead rows 0."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    rows = []
    out = torch.zeros_like(q)
    for (qs, lq), (ks, lk) in zip(segments(params, "q"), segments(params, "kv"), strict=True):
        if lq:
            doc = document_attention(
                q[qs : qs + lq], k[ks : ks + lk], v[ks : ks + lk], causal=causal, scale=scale, **options
            )
            rows.append((qs, lq, doc))
    for qs, lq, doc in rows:  # out-of-place so that autograd sees one graph
        out = out.index_put((torch.arange(qs, qs + lq),), doc)
    return out


def through(fn, params, **kwargs):
    """``(q, k, v, sinks) -> fn(q, k, v, params, sinks=sinks, **kwargs)``: the library or the loop."""
    return lambda q, k, v, sinks: fn(q, k, v, params, sinks=sinks, **kwargs)


def forward_backward(fn, q, k, v, sinks, weight):
    """``fn(q, k, v, sinks)`` and the grads of ``(out * weight).sum()`` w.r.t. q, k, v (and sinks); zeros for
    inputs the output does not depend on."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    sink_leaf = None if sinks is None else sinks.detach().clone().requires_grad_()
    out = fn(*leaves, sink_leaf)
    wanted = leaves + ([] if sink_leaf is None else [sink_leaf])
    if not out.requires_grad:  # no live row
        return out.detach(), [torch.zeros_like(x) for x in wanted]
    grads = torch.autograd.grad((out * weight).sum(), wanted, allow_unused=True)
    return out.detach(), [torch.zeros_like(x) if g is None else g for x, g in zip(wanted, grads, strict=True)]


def assert_matches_loop(got, want, params, rows_q, rows_k, what, *, rtol=1e-10, atol=1e-12):
    (out, grads), (want_out, want_grads) = got, want
    names = ["out", "dq", "dk", "dv", "dsinks"]
    for name, a, b in zip(names, [out, *grads], [want_out, *want_grads], strict=False):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{what}: {name}: {m}")
    live_q, live_k = live_rows(params, "q", rows_q), live_rows(params, "kv", rows_k)
    for name, t, live in zip(names[:4], [out, *grads[:3]], [live_q, live_q, live_k, live_k], strict=True):
        dead = t[~live]
        assert torch.equal(dead, torch.zeros_like(dead)), f"{what}: dead rows of {name} must be exact zeros"


def random_options(rng, combo, hq):
    """(causal, options) for one trial of ``combo``: windows of every kind, softcaps from tight to loose, sinks
    from negligible to dominant."""
    causal = rng.random() < 0.5
    options = {}
    if "window" in combo:
        options["window"] = (rng.choice([-1, 0, 1, 2, 5]), rng.choice([-1, 0, 1, 3]))
    if "softcap" in combo:
        options["softcap"] = rng.choice([0.5, 2.0, 30.0])
    if "sinks" in combo:
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        options["sinks"] = (torch.randn(hq, generator=g, dtype=F64) * 2).requires_grad_(False)
    return causal, options


# ------------------------------------------------------------------------------------------------ reference path
COMBOS = ["window", "softcap", "sinks", "sinks+window", "softcap+window", "softcap+sinks+window"]


@pytest.mark.parametrize("combo", COMBOS)
def test_reference_matches_loop_on_random_packings(combo):
    """Self and cross-attention shapes (bottom-right aligned), padded layouts, zero-length documents, ghost slots,
    tail rows and GQA, through ``varlen_attention`` on the CPU (the reference)."""
    rng = random.Random(f"ref-{combo}")
    for trial in range(50):
        params, rows_q, rows_k = random_packing(rng)
        hq, hkv = rng.choice([(1, 1), (2, 2), (2, 1), (4, 2), (6, 3)])
        d = rng.choice([2, 4])
        causal, options = random_options(rng, combo, hq)
        sinks = options.pop("sinks", None)
        scale = rng.choice([None, 0.3])
        g = torch.Generator().manual_seed(trial)
        q = torch.randn(rows_q, hq, d, generator=g, dtype=F64) * 2
        k, v = (torch.randn(rows_k, hkv, d, generator=g, dtype=F64) * 2 for _ in range(2))
        weight = torch.randn(rows_q, hq, d, generator=g, dtype=F64)

        kwargs = dict(causal=causal, softmax_scale=scale, **options)
        library, loop = through(varlen_attention, params, **kwargs), through(naive, params, **kwargs)
        what = f"trial {trial} {params} heads {hq}/{hkv} causal={causal} {options} sinks={sinks is not None}"
        got = forward_backward(library, q, k, v, sinks, weight)
        assert_matches_loop(got, forward_backward(loop, q, k, v, sinks, weight), params, rows_q, rows_k, what)
        ref = varlen_attention_reference(q, k, v, params, causal=causal, softmax_scale=scale, sinks=sinks, **options)
        assert torch.equal(ref, got[0]), what


@pytest.mark.parametrize("window", [(0, 0), (2, 0), (1, 3), (-1, 2), (4, -1)])
def test_cross_shapes_window_is_bottom_right_aligned(window):
    """q/kv lengths differ per document, len_kv < len_q included: the window's diagonal is ``i + len_kv - len_q``."""
    lq, lk = [3, 5, 2, 0, 4, 6], [6, 2, 2, 3, 0, 9]
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lq, lk)]
    params = PackedSeqParams(cu_seqlens_q=cu[0], cu_seqlens_kv=cu[1], max_seqlen_q=6, max_seqlen_kv=9)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lq) + 2, 4, 8, generator=g, dtype=F64)
    k, v = (torch.randn(sum(lk) + 3, 2, 8, generator=g, dtype=F64) for _ in range(2))
    for causal in (True, False):
        want = naive(q, k, v, params, causal=causal, window=window)
        got = varlen_attention(q, k, v, params, causal=causal, window=window)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # document 5 (len_q 6, len_kv 9, shift 3), window (0, 0) without causal: query i sees key i + 3 alone
    if window == (0, 0):
        assert torch.equal(got[14:20], v[13 + 3 : 13 + 9].repeat_interleave(2, dim=1))


def test_equivalent_windows_are_the_same_call():
    """A window that bounds nothing is no window, ``(left, 0)`` is causal with ``left``, and ``causal`` drops the
    right bound: bit for bit, on the reference."""
    params = PackedSeqParams.from_seqlens([5, 0, 7, 1], capacity=6, total_tokens=16, pad_to_multiple=2)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(16, 2, 4, generator=g, dtype=F64) for _ in range(3))

    def attend(causal, window):
        return varlen_attention(q, k, v, params, causal=causal, window=window)

    assert torch.equal(attend(False, (-1, -1)), attend(False, None))
    assert torch.equal(attend(False, (-1, 0)), attend(True, None))
    assert torch.equal(attend(True, (-1, 5)), attend(True, None))
    assert torch.equal(attend(True, [3, 7]), attend(False, (3, 0)))
    assert not torch.equal(attend(True, (3, 0)), attend(True, None))
    none = dict(window=None, softcap=None, sinks=None)
    assert torch.equal(varlen_attention(q, k, v, params, **none), varlen_attention(q, k, v, params))


def test_sinks_in_half_precision_and_another_dtype():
    """bf16 q/k/v with float32 sinks: computed in float32, the sinks' grad in their own dtype."""
    params = PackedSeqParams.from_seqlens([5, 9, 2], capacity=4, total_tokens=20)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(20, 4, 8, generator=g, dtype=F64) for _ in range(3))
    sinks = torch.randn(4, generator=g, dtype=F64)
    weight = torch.randn(20, 4, 8, generator=g, dtype=F64)

    def library(q, k, v, s):
        out = varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), params, window=(3, 0), sinks=s.float())
        assert out.dtype == torch.bfloat16
        return out.double()

    got = forward_backward(library, q, k, v, sinks, weight)
    want = forward_backward(
        lambda *a: naive(*a[:3], params, causal=True, window=(3, 0), sinks=a[3]), q, k, v, sinks, weight
    )
    assert_matches_loop(got, want, params, 20, 20, "bf16", rtol=3e-2, atol=3e-2)


def test_sinks_alone_require_grad():
    """Frozen q/k/v and learnable sinks (a head-only fine-tune): the sinks' grad is the loop's, q/k/v get none."""
    params = PackedSeqParams.from_seqlens([4, 6], capacity=3, total_tokens=12)
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(12, 2, 4, generator=g, dtype=F64) for _ in range(3))
    sinks = torch.randn(2, generator=g, dtype=F64, requires_grad=True)
    varlen_attention(q, k, v, params, sinks=sinks).pow(2).sum().backward()
    ref = sinks.detach().clone().requires_grad_()
    naive(q, k, v, params, causal=True, sinks=ref).pow(2).sum().backward()
    torch.testing.assert_close(sinks.grad, ref.grad, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(window=(2,)), "window must be None or"),
        (dict(window=(-2, 0)), "window must be None or"),
        (dict(window=(1.5, 0)), "window must be None or"),
        (dict(window=(True, 0)), "window must be None or"),
        (dict(window=5), "window must be None or"),
        (dict(softcap=0.0), "softcap must be None or a finite number > 0"),
        (dict(softcap=-1.0), "softcap must be None or a finite number > 0"),
        (dict(softcap=math.inf), "softcap must be None or a finite number > 0"),
        (dict(softcap=math.nan), "softcap must be None or a finite number > 0"),
        (dict(softcap=torch.tensor(2.0)), "softcap must be None or a finite number > 0"),
        (dict(sinks=torch.zeros(3)), r"sinks must be a 1-D tensor of one logit per query head \(4\), got \[3\]"),
        (dict(sinks=torch.zeros(4, 1)), r"sinks must be a 1-D tensor .* got \[4, 1\]"),
        (dict(sinks=[0.0] * 4), "sinks must be a 1-D tensor .* got list"),
        (dict(sinks=torch.zeros(4, dtype=torch.int64)), "sinks must be floating point, got torch.int64"),
        (dict(sinks=torch.zeros(4, device="meta")), "sinks must be on q's device"),
    ],
)
@pytest.mark.parametrize("op", [varlen_attention, varlen_attention_reference])
def test_rejects_bad_options(op, kwargs, match):
    params = PackedSeqParams.from_seqlens([3, 2])
    q = torch.zeros(5, 4, 8)
    with pytest.raises(ValueError, match=match) as e:
        op(q, q[:, :2], q[:, :2], params, **kwargs)
    assert str(e.value).startswith("varlen_attention: ") and "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------ FA2 path (fakes)
def flash_api(monkeypatch, version, calls):
    """Route ``varlen_attention`` on these CPU tensors to the FA2 path, with the fake ``varlen_attn`` of
    ``version``."""
    api = attention_mod._VarlenAPI.from_function(fake_apis(calls)[version])
    monkeypatch.setattr(attention_mod, "_flash_eligible", lambda q: True)
    monkeypatch.setattr(attention_mod, "_torch_varlen_api", lambda: api)
    return api


FLASH_CASES = {
    "tail_rows": dict(lengths=[4, 3, 9], capacity=4, total_tokens=20),
    # padding segments (7, 6 and 3 rows) longer than max_seqlen: FA2 leaves their far rows unwritten
    "long_padding": dict(lengths=[1, 2, 0, 5], capacity=5, total_tokens=40, pad_to_multiple=8),
    "zero_length_docs": dict(lengths=[0, 6, 0, 3, 0]),
    "one_token_docs": dict(lengths=[1, 1, 0, 1], capacity=5, total_tokens=7, pad_to_multiple=2),
}
WINDOWS = [(0, 0), (2, 0), (3, 1), (-1, 2), (1, -1), (2, 6)]


@pytest.mark.parametrize("version", ["2.11", "2.12"])
@pytest.mark.parametrize("case", list(FLASH_CASES))
def test_flash_window_matches_loop(monkeypatch, version, case):
    kw = dict(FLASH_CASES[case])
    lengths = kw.pop("lengths")
    params = PackedSeqParams.from_seqlens(lengths, max_seqlen=max(lengths) + 1, **kw)
    calls = []
    flash_api(monkeypatch, version, calls)
    t = params.total_tokens
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(t, h, 8, generator=g, dtype=F64) for h in (4, 2, 2))
    weight = torch.randn(t, 4, 8, generator=g, dtype=F64)
    for window in WINDOWS:
        for causal in (True, False):
            calls.clear()
            got = forward_backward(
                through(varlen_attention, params, causal=causal, window=window),
                q,
                k,
                v,
                None,
                weight,
            )
            want = forward_backward(through(naive, params, causal=causal, window=window), q, k, v, None, weight)
            assert_matches_loop(got, want, params, t, t, f"{case} {version} causal={causal} window={window}")
            expected = (window[0], 0) if causal or window[1] == 0 else window
            assert [c["window_size"] for c in calls] == [expected], calls  # one FA2 call, the canonical window


def test_flash_window_cross_shapes_and_the_bound_fa2_drops(monkeypatch):
    """Cross shapes through the FA2 fake, bottom-right aligned. FA2 drops a right bound that reaches max_seqlen_kv:
    where that would change the result (a q document longer than right + 1), the reference runs instead."""
    lq, lk = [3, 5, 2, 0, 4, 8], [6, 2, 2, 3, 0, 3]
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lq, lk)]
    g = torch.Generator().manual_seed(12)
    q = torch.randn(sum(lq) + 2, 4, 8, generator=g, dtype=F64)
    k, v = (torch.randn(sum(lk) + 3, 2, 8, generator=g, dtype=F64) for _ in range(2))
    calls = []
    flash_api(monkeypatch, "2.12", calls)
    for max_q, window, flash in (
        (8, (1, 2), True),  # right < max_seqlen_kv (6): FA2 keeps it
        (8, (2, 6), False),  # right >= 6 and max_seqlen_q 8 > right + 1: FA2 would see keys past i + shift + 6
        (7, (2, 6), True),  # max_seqlen_q <= right + 1: dropping the bound changes nothing
        (8, (-1, 7), True),  # the same at the largest query
    ):
        if max_q == 7:
            lq_ = [3, 5, 2, 0, 4, 7]
            cu_q = torch.tensor([0, *torch.tensor(lq_).cumsum(0).tolist()], dtype=torch.int32)
        else:
            cu_q = cu[0]
        params = PackedSeqParams(cu_seqlens_q=cu_q, cu_seqlens_kv=cu[1], max_seqlen_q=max_q, max_seqlen_kv=6)
        calls.clear()
        got = varlen_attention(q, k, v, params, causal=False, window=window)
        want = naive(q, k, v, params, causal=False, window=window)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert bool(calls) == flash, (max_q, window, calls)
        if not flash:  # and FA2 would indeed be wrong there (the fake drops the bound as FA2 does)
            api = attention_mod._torch_varlen_api()
            fa2 = attention_mod._flash_attention(
                q, k, v, params, causal=False, softmax_scale=None, api=api, window=window
            )
            assert not torch.allclose(fa2, want)


def test_flash_window_needs_torch_2_11(monkeypatch):
    params = PackedSeqParams.from_seqlens([3, 4], max_seqlen=4)
    calls = []
    flash_api(monkeypatch, "2.10", calls)
    q = torch.randn(7, 2, 8, dtype=F64)
    with pytest.raises(NotImplementedError, match=r"window .* needs torch >= 2\.11") as e:
        varlen_attention(q, q, q, params, window=(2, 0))
    assert "\n" not in str(e.value) and not calls
    varlen_attention(q, q, q, params, window=(-1, 0))  # no bound: plain causal, which 2.10 takes


@pytest.mark.parametrize("options", [dict(softcap=5.0), dict(sinks=torch.zeros(4)), dict(softcap=1.0, window=(2, 0))])
def test_softcap_and_sinks_run_the_reference_where_flash_would_run(monkeypatch, options):
    params = PackedSeqParams.from_seqlens([3, 6], capacity=3, total_tokens=10, max_seqlen=6)
    calls = []
    flash_api(monkeypatch, "2.12", calls)
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(10, h, 8, generator=g, dtype=F64) for h in (4, 2, 2))
    if "sinks" in options:
        options = dict(options, sinks=options["sinks"].double())
    got = varlen_attention(q, k, v, params, **options)
    assert not calls
    assert torch.equal(got, varlen_attention_reference(q, k, v, params, **options))


@pytest.mark.parametrize("pad", [1, 2])
def test_flash_chunked_backward_passes_the_window_to_every_chunk(monkeypatch, pad):
    """Offsets of more slots than SLOTS_PER_BACKWARD (here 2) run the FA2 backward in chunks of slots
    (packgraph.ops.flash_chunks, through fake aten ops): every chunk gets the window; the grads are the loop's."""
    params = PackedSeqParams.from_seqlens(
        [5, 1, 0, 7, 3, 2], capacity=7, total_tokens=30, pad_to_multiple=pad, max_seqlen=8
    )
    calls, chunk_calls = [], []
    flash_api(monkeypatch, "2.12", calls)
    forward, backward = fake_chunk_ops(chunk_calls)
    monkeypatch.setattr(flash_chunks, "flash_forward", forward)
    monkeypatch.setattr(flash_chunks, "flash_backward", backward)
    monkeypatch.setattr(attention_mod, "SLOTS_PER_BACKWARD", 2)
    monkeypatch.setattr(flash_chunks, "SLOTS_PER_BACKWARD", 2)
    g = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(30, h, 8, generator=g, dtype=F64) for h in (4, 2, 2))
    weight = torch.randn(30, 4, 8, generator=g, dtype=F64)
    slots = attention_mod.flash_offsets(params)[0].numel() - 1
    for causal, window in ((True, (2, 0)), (False, (1, 2)), (True, None), (False, (-1, 3))):
        chunk_calls.clear()
        got = forward_backward(through(varlen_attention, params, causal=causal, window=window), q, k, v, None, weight)
        want = forward_backward(through(naive, params, causal=causal, window=window), q, k, v, None, weight)
        assert_matches_loop(got, want, params, 30, 30, f"pad {pad} causal={causal} window={window}")
        expected = None if window is None else (window[0], 0) if causal else window
        assert not calls, "the chunked path runs aten's ops, not varlen_attn"
        assert chunk_calls[0] == ("forward", slots, expected)
        backward_calls = chunk_calls[1:]
        assert len(backward_calls) >= 3 and sum(n for _, n, _ in backward_calls) == slots, chunk_calls
        assert all(kind == "backward" and w == expected for kind, _, w in backward_calls), chunk_calls


SHORT_CASES = {
    "mixed": ([3, 200, 1, 1, 60, short_docs.BLOCK, short_docs.BLOCK + 1, 5, 250], 16, 900),
    "long_first_and_last": ([300, 2, 3, 130], 8, 440),
}


@pytest.mark.parametrize("left", [0, 5, short_docs.BLOCK, short_docs.BLOCK + 1, 200])
@pytest.mark.parametrize("case", list(SHORT_CASES))
def test_short_docs_window_matches_loop(monkeypatch, case, left):
    """short_docs (local blocks + one FA2 call on the long documents) with a causal window: the local mask keeps
    ``left`` keys; up to BLOCK every document runs in local blocks and no FA2 call is made."""
    lengths, capacity, total = SHORT_CASES[case]
    params = PackedSeqParams.from_seqlens(lengths, capacity=capacity, total_tokens=total, max_seqlen=max(lengths))
    params = params.replace(short_docs_min_slots=1)
    calls = []
    flash_api(monkeypatch, "2.12", calls)
    g = torch.Generator().manual_seed(15)
    q, k, v = (torch.randn(total, h, 8, generator=g, dtype=F64) for h in (4, 2, 2))
    weight = torch.randn(total, 4, 8, generator=g, dtype=F64)
    assert attention_mod._short_docs_apply(q, k, params, True)
    window = (left, 0)
    got = forward_backward(lambda q, k, v, s: varlen_attention(q, k, v, params, window=window), q, k, v, None, weight)
    want = forward_backward(
        lambda q, k, v, s: naive(q, k, v, params, causal=True, window=window), q, k, v, None, weight
    )
    assert_matches_loop(got, want, params, total, total, f"{case} window={window}")
    if left <= short_docs.BLOCK:
        assert not calls
    else:
        assert [(c["slots"], c["window_size"]) for c in calls] == [(short_docs.long_doc_slots(total), window)]
