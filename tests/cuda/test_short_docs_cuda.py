"""GPU checks of packgraph.ops.short_docs at the bucket tour's scale: T=2048, 2048 slots, one long document among
hundreds of short ones (and corpus-like mixes), with ``short_docs_min_slots`` at 512 (129 by default: these
buckets run it either way).

Against the float64 reference and against one FA2 call on every slot (the path it replaces): the same outputs and
grads, no NaN, dead rows zero; a lower backward peak; and a CUDA-graph replay on new offsets, with no host sync,
bitwise equal to eager under deterministic kernels. The same with a causal sliding window, short (every document in
local blocks) and long (the long documents in one FA2 call with the window).
"""

import random

import pytest
import torch

from packgraph import PackedSeqParams
from packgraph.ops import attention as attention_mod
from packgraph.ops import short_docs, varlen_attention, varlen_attention_reference

DEVICE = "cuda"
T, HQ, D, CAPACITY, MAX_SEQLEN = 2048, 8, 64, 2048, 2048


def _lengths(kind, seed):
    rng = random.Random(seed)
    if kind == "tour":  # the tour's largest bucket: one document of 1025 and 512 of one token
        return [1] * rng.randint(0, 300) + [1025] + [1] * 512
    lengths = []
    while sum(lengths) < T - 300:
        lengths.append(rng.choice([1, 2, 5, rng.randint(1, 128), 129, rng.randint(129, 700)]))
    return lengths


def _params(lengths):
    return (
        PackedSeqParams.from_seqlens(lengths, capacity=CAPACITY, total_tokens=T, max_seqlen=MAX_SEQLEN, device=DEVICE)
        .attention_view()
        .replace(short_docs_min_slots=512)
    )


def _one_fa2_call(params):
    """The same params with the switch off: one FA2 call on every slot."""
    return params.replace(short_docs_min_slots=None)


def _inputs(hkv, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(T, HQ, D, device=DEVICE, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(T, hkv, D, device=DEVICE, generator=g).bfloat16().requires_grad_() for _ in range(2))
    return q, k, v, torch.randn(T, HQ, D, device=DEVICE, generator=g).bfloat16()


def _fwd_bwd(q, k, v, grad, params, **options):
    out = varlen_attention(q, k, v, params, **options)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("hkv", [HQ, 2])
@pytest.mark.parametrize("kind", ["tour", "corpus"])
def test_short_docs_match_float64_and_the_one_call_path(monkeypatch, kind, hkv, report):
    params = _params(_lengths(kind, 0))
    q, k, v, grad = _inputs(hkv, 1)
    assert attention_mod._short_docs_apply(q, k, params, True)
    got = _fwd_bwd(q, k, v, grad, params)
    one_call = _fwd_bwd(q, k, v, grad, _one_fa2_call(params))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out = varlen_attention_reference(qd, kd, vd, params)
    ref = (ref_out, *torch.autograd.grad(ref_out, (qd, kd, vd), grad.double()))
    live = torch.zeros(T, dtype=torch.bool, device=DEVICE)
    live[: params.cu_seqlens_q[-1]] = True
    worst = 0.0
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), got, one_call, ref, strict=True):
        assert not a.isnan().any(), name
        assert torch.equal(a[~live], torch.zeros_like(a[~live])), f"{name}: dead rows must be exact zeros"
        err, err_one = _rel(a, r), _rel(b, r)
        worst = max(worst, err)
        # as close to float64 as the one-call path is (both bf16), and to it
        assert err < max(2 * err_one, 1e-2), f"{name}: {err:.3g} vs the one-call path's {err_one:.3g}"
        assert _rel(a, b) < 2e-2, name
    report(f"short-docs bf16 vs fp64 ref ({kind}, hkv {hkv}): max rel err", worst)


def test_backward_peak_is_below_the_one_call_peak(monkeypatch, report):
    params = _params(_lengths("tour", 2))
    q, k, v, grad = _inputs(HQ, 3)

    def backward_peak(params):
        out = varlen_attention(q, k, v, params)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.autograd.grad(out, (q, k, v), grad)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    short = backward_peak(params)
    one_call = backward_peak(_one_fa2_call(params))  # chunked over slots (packgraph.ops.flash_chunks)
    report("short-docs backward peak / one FA2 call's (chunked), tour bucket", short / one_call)
    assert short < 0.5 * one_call, (short / 2**20, one_call / 2**20)


def test_replays_in_a_graph_on_new_offsets_bitwise_equal_eager():
    first, second = (_params(_lengths(kind, s)) for kind, s in (("tour", 4), ("corpus", 5)))
    q, k, v, grad = _inputs(2, 6)
    static = first
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _fwd_bwd(q, k, v, grad, static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = _fwd_bwd(q, k, v, grad, static)
        for name in ("cu_seqlens_q", "cu_seqlens_kv"):
            getattr(static, name).copy_(getattr(second, name))
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
            eager = _fwd_bwd(q, k, v, grad, second)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    for name, a, b in zip(("out", "dq", "dk", "dv"), outs, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    del graph


@pytest.mark.parametrize("hkv", [HQ, 2])
def test_local_path_grads_are_exact_zeros_off_the_short_documents(hkv):
    """The local path's grads need no mask: with its output grad zero outside the short documents' rows (as the
    caller's select makes it), its q/k/v grads there are exact zeros, through the GPU's SDPA kernel too."""
    params = _params(_lengths("corpus", 7))
    q, k, v, grad = _inputs(hkv, 8)
    rows = attention_mod.row_layout(params, "q", T)
    short = rows.live & (rows.length <= short_docs.BLOCK)
    assert 0 < int(short.sum()) < int(rows.live.sum())
    mask = short_docs.local_mask(rows.slot, q.dtype)
    out = short_docs._LocalRecomputed.apply(q, k, v, mask, D**-0.5)
    got = torch.autograd.grad(out, (q, k, v), torch.where(short[:, None, None], grad, 0))
    for name, g in zip("qkv", got, strict=True):
        assert torch.equal(g[~short], torch.zeros_like(g[~short])), name
        assert g[short].abs().sum() > 0, name


def _needs_window_size():
    api = attention_mod._torch_varlen_api()
    if api is None or api.causal_kw != "window_size":
        pytest.skip(f"torch {torch.__version__}: varlen_attn has no window_size")


@pytest.mark.parametrize("hkv", [HQ, 2])
@pytest.mark.parametrize("left", [64, short_docs.BLOCK, 300])
@pytest.mark.parametrize("kind", ["tour", "corpus"])
def test_short_docs_with_a_window_match_float64_and_the_one_call_path(monkeypatch, kind, left, hkv, report):
    """A causal window of ``left`` keys: up to BLOCK every document runs in local blocks (no FA2 call), past it
    the long documents run one FA2 call with the window. Both against the float64 reference and one FA2 call."""
    _needs_window_size()
    params = _params(_lengths(kind, 10))
    q, k, v, grad = _inputs(hkv, 11)
    assert attention_mod._short_docs_apply(q, k, params, True)
    window = (left, 0)
    calls = []
    flash = attention_mod._run_flash

    def spied(*args, **kwargs):
        calls.append(kwargs.get("window"))
        return flash(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(attention_mod, "_run_flash", spied)
        got = _fwd_bwd(q, k, v, grad, params, window=window)
    assert calls == ([] if left <= short_docs.BLOCK else [window]), calls
    one_call = _fwd_bwd(q, k, v, grad, _one_fa2_call(params), window=window)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out = varlen_attention_reference(qd, kd, vd, params, window=window)
    ref = (ref_out, *torch.autograd.grad(ref_out, (qd, kd, vd), grad.double()))
    live = torch.zeros(T, dtype=torch.bool, device=DEVICE)
    live[: params.cu_seqlens_q[-1]] = True
    worst = 0.0
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), got, one_call, ref, strict=True):
        assert not a.isnan().any(), name
        assert torch.equal(a[~live], torch.zeros_like(a[~live])), f"{name}: dead rows must be exact zeros"
        err, err_one = _rel(a, r), _rel(b, r)
        worst = max(worst, err)
        assert err < max(2 * err_one, 1e-2), f"{name}: {err:.3g} vs the one-call path's {err_one:.3g}"
        assert _rel(a, b) < 2e-2, name
    report(f"short-docs window {window} bf16 vs fp64 ref ({kind}, hkv {hkv}): max rel err", worst)


@pytest.mark.parametrize("left", [64, 300])
def test_windowed_short_docs_replay_in_a_graph_bitwise_equal_eager(left):
    """Under deterministic kernels, a captured windowed call replays on new offsets bit for bit as eager."""
    _needs_window_size()
    first, second = (_params(_lengths(kind, s)) for kind, s in (("tour", 12), ("corpus", 13)))
    q, k, v, grad = _inputs(2, 14)
    window = (left, 0)
    static = first
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _fwd_bwd(q, k, v, grad, static, window=window)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = _fwd_bwd(q, k, v, grad, static, window=window)
        for name in ("cu_seqlens_q", "cu_seqlens_kv"):
            getattr(static, name).copy_(getattr(second, name))
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
            eager = _fwd_bwd(q, k, v, grad, second, window=window)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    for name, a, b in zip(("out", "dq", "dk", "dv"), outs, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    del graph
