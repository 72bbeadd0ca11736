"""GPU checks of the slot-chunked FA2 backward (``packgraph.ops.flash_chunks``): above 512 slots
``varlen_attention``'s backward runs once per chunk of slots.

Against the one-call backward (the same op with the chunk size raised past the slot count): equal outputs and
grads, a much lower backward peak, a CUDA-graph replay on new offsets equal to eager, and no host sync; with a
sliding window, which reaches every chunk, the same equality. Documents
here span at most two 128-row key blocks, so FA2's fp32 atomic dq sums have at most two terms and the one-call
backward is deterministic: the comparison can be exact.
"""

import random

import pytest
import torch

from packgraph import PackedSeqParams
from packgraph.ops import attention as attention_mod
from packgraph.ops import varlen_attention

DEVICE = "cuda"
T, HQ, D, MAX_SEQLEN = 2048, 8, 64, 256


def _lengths(n_docs, seed, pad):
    rng = random.Random(seed)
    lengths = [MAX_SEQLEN] + [rng.choice([1, 1, 2, 3, rng.randint(1, 40)]) for _ in range(n_docs - 1)]
    while sum(-(-n // pad) * pad for n in lengths) > T - 5:  # keep a tail
        lengths.pop()
    return lengths


def _params(lengths, capacity, pad):
    """The subject is FA2's backward over all the slots, chunked or not: short_docs (the switch) is off."""
    return PackedSeqParams.from_seqlens(
        lengths, capacity=capacity, total_tokens=T, pad_to_multiple=pad, max_seqlen=MAX_SEQLEN, device=DEVICE
    ).replace(short_docs_min_slots=None)


def _inputs(hkv, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(T, HQ, D, device=DEVICE, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(T, hkv, D, device=DEVICE, generator=g).bfloat16().requires_grad_() for _ in range(2))
    return q, k, v, torch.randn(T, HQ, D, device=DEVICE, generator=g).bfloat16()


def _fwd_bwd(q, k, v, grad, params, **options):
    out = varlen_attention(q, k, v, params, **options)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


def _one_call(monkeypatch):
    monkeypatch.setattr(attention_mod, "SLOTS_PER_BACKWARD", 10**9)


@pytest.mark.parametrize("hkv", [HQ, 2])
@pytest.mark.parametrize("pad, capacity, n_docs", [(1, 2048, 545), (8, 1024, 200)])
def test_chunked_backward_equals_the_one_call_backward(monkeypatch, hkv, pad, capacity, n_docs):
    params = _params(_lengths(n_docs, 0, pad), capacity, pad)
    assert attention_mod.flash_offsets(params)[0].numel() - 1 > attention_mod.SLOTS_PER_BACKWARD  # chunked
    q, k, v, grad = _inputs(hkv, 1)
    chunked = _fwd_bwd(q, k, v, grad, params)
    with monkeypatch.context() as m:
        _one_call(m)
        one_call = _fwd_bwd(q, k, v, grad, params)
    for name, a, b in zip(("out", "dq", "dk", "dv"), chunked, one_call, strict=True):
        assert not a.isnan().any(), name
        if hkv == HQ:
            assert torch.equal(a, b), f"{name}: chunked and one-call backward differ"
        else:  # the one-call path may sum GQA groups through autograd (repeat_kv), the chunked one in FA2
            torch.testing.assert_close(a, b, msg=name)
    # and both are attention: against the float64 reference
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _fwd_bwd(qd, kd, vd, grad.double(), params)
    for name, a, r in zip(("out", "dq", "dk", "dv"), chunked, ref, strict=True):
        err = ((a.double() - r).norm() / r.norm().clamp_min(1e-30)).item()
        assert err < 2e-2, f"{name}: relative error {err:.3g} against the float64 reference"


def test_chunked_backward_peak_is_a_fraction_of_the_one_call_peak(monkeypatch):
    params = _params(_lengths(545, 2, 1), 2048, 1)
    q, k, v, grad = _inputs(HQ, 3)

    def backward_peak():
        out = varlen_attention(q, k, v, params)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.autograd.grad(out, (q, k, v), grad)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    chunked = backward_peak()
    with monkeypatch.context() as m:
        _one_call(m)
        one_call = backward_peak()
    # one call: an fp32 dq accumulator of (T + 128 x 2048) rows x 8 heads x 64 = 516 MiB; chunks of 512 slots hold
    # (T + 128 x 512) rows (bench/results/2026-12-01-h200-fa-ghosts/: 158 against 530 MiB for the whole backward)
    assert chunked < 0.4 * one_call, (chunked / 2**20, one_call / 2**20)


def test_chunked_backward_replays_in_a_graph_on_new_offsets():
    capacity = 2048
    first, second = (_params(_lengths(n, s, 1), capacity, 1) for n, s in ((545, 4), (900, 5)))
    q, k, v, grad = _inputs(2, 6)
    static = first.attention_view()
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
    for name, a, b in zip(("out", "dq", "dk", "dv"), outs, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    del graph


@pytest.mark.parametrize("hkv", [HQ, 2])
@pytest.mark.parametrize("causal, window", [(True, (8, 0)), (False, (4, 16)), (False, (-1, 2))])
def test_chunked_backward_with_a_window_equals_the_one_call_backward(monkeypatch, hkv, causal, window):
    """The window reaches the forward and every chunk's backward: the chunked grads are the one-call ones (which
    take the window through varlen_attn), bitwise without GQA, and both are the float64 reference's."""
    api = attention_mod._torch_varlen_api()
    if api is None or api.causal_kw != "window_size":
        pytest.skip(f"torch {torch.__version__}: varlen_attn has no window_size")
    params = _params(_lengths(545, 7, 1), 2048, 1)
    q, k, v, grad = _inputs(hkv, 8)
    options = dict(causal=causal, window=window)
    chunked = _fwd_bwd(q, k, v, grad, params, **options)
    with monkeypatch.context() as m:
        _one_call(m)
        one_call = _fwd_bwd(q, k, v, grad, params, **options)
    for name, a, b in zip(("out", "dq", "dk", "dv"), chunked, one_call, strict=True):
        assert not a.isnan().any(), name
        if hkv == HQ:
            assert torch.equal(a, b), f"{name}: chunked and one-call backward differ"
        else:
            torch.testing.assert_close(a, b, msg=name)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _fwd_bwd(qd, kd, vd, grad.double(), params, **options)
    no_window = _fwd_bwd(qd, kd, vd, grad.double(), params, causal=causal)
    for name, a, r in zip(("out", "dq", "dk", "dv"), chunked, ref, strict=True):
        err = ((a.double() - r).norm() / r.norm().clamp_min(1e-30)).item()
        assert err < 2e-2, f"{name}: relative error {err:.3g} against the float64 reference"
    err = ((ref[0] - no_window[0]).norm() / no_window[0].norm()).item()
    assert err > 2e-2, "the window must change this attention, or the test shows nothing"
