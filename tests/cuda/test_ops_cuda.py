"""GPU checks of the THD ops: FA2 varlen path vs the float64 reference, raw CUDA-graph replay vs eager over many
packings (forward, and backward inside the capture), and no host sync under ``set_sync_debug_mode("error")``.
varlen_attention's options (issue #32): FA2 with sliding windows (one call and short_docs) against float64 and
through a graph replay; softcap and sinks (the reference on CUDA) against float64 and through a graph replay.

Every test here is marked ``cuda`` by tests/conftest.py and skipped without a GPU.
"""

import random
import sys

import pytest
import torch

from packgraph import PackedSeqParams
from packgraph.ops import apply_rope_thd, varlen_attention, varlen_attention_reference
from packgraph.ops import attention as attention_mod

DEVICE = "cuda"
T, CAPACITY, MAX_SEQLEN = 512, 16, 256
HQ, HKV, D = 8, 2, 64


# ------------------------------------------------------------------------------------------------ helpers
def packings(count, *, seed, pad):
    """Host-side document lengths that fit T: fixed edge cases first, then random mixes (1-token and
    zero-length docs, ghost slots, tail rows)."""
    out = [
        [MAX_SEQLEN],  # one long document, a long tail
        [1] * CAPACITY,  # every slot a 1-token document
        [3, 0, 0, 5, 1],  # zero-length documents in the middle, ghost slots after
        [],  # no document: every row is dead
    ]
    rng = random.Random(seed)
    while len(out) < count:
        lengths, used = [], 0
        for _ in range(rng.randint(1, CAPACITY)):
            n = rng.choice([0, 1, rng.randint(1, MAX_SEQLEN), rng.randint(1, MAX_SEQLEN // 4)])
            cost = -(-n // pad) * pad
            if used + cost > T:
                break
            lengths.append(n)
            used += cost
        out.append(lengths)
    return out


def make_params(lengths, pad):
    return PackedSeqParams.from_seqlens(
        lengths, capacity=CAPACITY, total_tokens=T, pad_to_multiple=pad, max_seqlen=MAX_SEQLEN, device=DEVICE
    )


def live_rows(lengths, pad):
    live = torch.zeros(T, dtype=torch.bool)
    start = 0
    for n in lengths:
        live[start : start + n] = True
        start += -(-n // pad) * pad
    return live.to(DEVICE)


def rope_attention(q, k, v, params, causal=True):
    """The captured region: RoPE on q and k, then varlen attention."""
    return varlen_attention(apply_rope_thd(q, params), apply_rope_thd(k, params), v, params, causal=causal)


def rel_err(got, want):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def assert_dead_rows_zero(t, live, what):
    dead = t.detach()[~live]
    assert torch.equal(dead, torch.zeros_like(dead)), f"{what}: dead rows must be exact zeros"


def randn(*shape, dtype=torch.bfloat16, requires_grad=False):
    return torch.randn(*shape, device=DEVICE, dtype=torch.float32).to(dtype).requires_grad_(requires_grad)


def assert_flash_path(q):
    assert attention_mod._flash_eligible(q), "this test must exercise the FA2 path"
    assert attention_mod._torch_varlen_api() is not None, f"torch {torch.__version__} has no varlen_attn"


# bf16 runs FA2, fp32 the reference; short_docs only applies to the plain (unpadded) layout.
DTYPE_PAD_PATHS = pytest.mark.parametrize(
    "dtype,pad,short_docs",
    [
        (torch.bfloat16, 1, False),
        (torch.bfloat16, 8, False),
        (torch.float32, 1, False),
        (torch.float32, 8, False),
        (torch.bfloat16, 1, True),
    ],
    ids=["bf16-flash-plain", "bf16-flash-padded8", "fp32-reference-plain", "fp32-reference-padded8", "short-docs"],
)


def use_short_docs(monkeypatch, q, k, params):
    """``params``, and every packing ``make_params`` builds for the rest of the test, with ``short_docs_min_slots``
    at 1: routed through packgraph.ops.short_docs (local blocks + one FA2 call on the long documents) although their
    capacity is below the default switch. Checks that it applies."""
    build = make_params
    monkeypatch.setattr(sys.modules[__name__], "make_params", lambda *a: build(*a).replace(short_docs_min_slots=1))
    switched = params.replace(short_docs_min_slots=1)
    assert attention_mod._short_docs_apply(q, k, switched, True)
    return switched


# ------------------------------------------------------------------------------------------------ FA2 vs reference
@pytest.mark.parametrize(
    "pad,causal,hkv,scale,short_docs",
    [
        (1, True, HQ, None, False),
        (1, False, HQ, None, False),
        (1, True, HKV, None, False),
        (1, False, 1, None, False),
        (8, True, HKV, None, False),
        (8, False, HKV, None, False),
        (8, True, 1, 0.05, False),
        (4, True, HQ, 0.2, False),
        (1, True, HQ, None, True),
        (1, True, HKV, None, True),
        (1, True, 1, 0.05, True),
    ],
)
def test_flash_matches_float64_reference(monkeypatch, pad, causal, hkv, scale, short_docs, report):
    # long and short documents, 1-token and zero-length ones, 8 ghost slots, a tail (and padding when pad > 1)
    lengths = [37, 1, 200, 0, 1, 64, 3, 1]
    params = make_params(lengths, pad)
    live = live_rows(lengths, pad)
    q, k, v = (
        randn(T, HQ, D, requires_grad=True),
        randn(T, hkv, D, requires_grad=True),
        randn(T, hkv, D, requires_grad=True),
    )
    assert_flash_path(q)
    if short_docs:
        params = use_short_docs(monkeypatch, q, k, params)
    weight = torch.randn(T, HQ, D, device=DEVICE)
    out = varlen_attention(q, k, v, params, causal=causal, softmax_scale=scale)
    assert out.dtype == torch.bfloat16 and out.shape == (T, HQ, D)
    (out.float() * weight).sum().backward()

    ref_leaves = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    ref = varlen_attention_reference(*ref_leaves, params.to("cpu"), causal=causal, softmax_scale=scale)
    (ref * weight.double().cpu()).sum().backward()

    errors = {"out": rel_err(out, ref)}
    errors.update({f"d{n}": rel_err(x.grad, r.grad) for n, x, r in zip("qkv", (q, k, v), ref_leaves, strict=True)})
    tag = (
        f"pad{pad} {'causal' if causal else 'full'} hq{HQ}/hkv{hkv} scale={scale}{' short-docs' if short_docs else ''}"
    )
    report(f"FA2 bf16 vs fp64 ref ({tag}): max rel err", max(errors.values()))
    for name, err in errors.items():
        assert err < 1e-2, f"{name}: relative error {err:.3g} ({tag})"
    assert_dead_rows_zero(out, live, "out")
    assert_dead_rows_zero(q.grad, live, "dq")
    assert_dead_rows_zero(k.grad, live, "dk")
    assert_dead_rows_zero(v.grad, live, "dv")


# ------------------------------------------------------------------------------------------------ isolation
@pytest.mark.parametrize(
    "dtype,pad",
    [(torch.bfloat16, 1), (torch.bfloat16, 8), (torch.float32, 1), (torch.float32, 8)],
    ids=["bf16-flash-plain", "bf16-flash-padded8", "fp32-reference-plain", "fp32-reference-padded8"],
)
def test_non_finite_rows_stay_in_their_document(dtype, pad, report):
    """NaN/Inf in every dead row (tail, padding) of q, k, v and the upstream grad, and in one document's rows, reach
    no other document: their outputs and grads equal a clean run's, and dead rows stay exact zeros."""
    lengths = [37, 1, 200, 0, 1, 64, 3, 1]
    params = make_params(lengths, pad)
    live = live_rows(lengths, pad)
    start = sum(-(-n // pad) * pad for n in lengths[:2])  # document 2, 200 tokens, gets poisoned
    poisoned = torch.zeros(T, dtype=torch.bool, device=DEVICE)
    poisoned[start : start + lengths[2]] = True
    others = live & ~poisoned
    q, k, v = randn(T, HQ, D, dtype=dtype), randn(T, HKV, D, dtype=dtype), randn(T, HKV, D, dtype=dtype)
    weight = torch.randn(T, HQ, D, device=DEVICE)
    if dtype == torch.bfloat16:
        assert_flash_path(q)

    def run(q, k, v, weight):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = rope_attention(*leaves, params)
        return out.detach(), torch.autograd.grad((out.float() * weight).sum(), leaves)

    clean_out, clean_grads = run(q, k, v, weight)
    nan, inf = float("nan"), float("inf")
    bad = [x.clone() for x in (q, k, v, weight)]
    for x, poison in zip(bad, (nan, inf, -inf, nan), strict=True):
        x[~live] = poison
    bad[0][start + 20, 3, 0] = inf
    bad[1][start + 99, 0, 5] = -inf
    bad[2][start + 150, 1, 7] = nan
    bad[3][start + 180, 5, 9] = nan
    out, grads = run(*bad)

    worst = 0.0
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (clean_out, *clean_grads), strict=True):
        assert torch.isfinite(got[others]).all(), f"{name}: NaN/Inf reached another document"
        # FA2's dq accumulates with float atomics: equal to the clean run up to summation order, not bitwise.
        err = rel_err(got[others], want[others])
        worst = max(worst, err)
        assert err < 5e-3, f"{name}: other documents differ from the clean run, rel err {err}"
        assert_dead_rows_zero(got, live, name)
    report(f"ops isolation under NaN/Inf ({dtype}, pad {pad}): max rel err vs clean run", worst)


# ------------------------------------------------------------------------------------------------ graph replay
class StaticParams:
    """Fixed-capacity cu_seqlens buffers that a graph reads; ``load`` copies a new packing in."""

    def __init__(self, lengths, pad):
        first = make_params(lengths, pad)
        self.cu = first.cu_seqlens_q.clone()
        self.cu_padded = first.cu_seqlens_q_padded.clone() if pad > 1 else None
        self.params = PackedSeqParams(
            cu_seqlens_q=self.cu,
            cu_seqlens_kv=self.cu,
            cu_seqlens_q_padded=self.cu_padded,
            cu_seqlens_kv_padded=self.cu_padded,
            max_seqlen_q=MAX_SEQLEN,
            max_seqlen_kv=MAX_SEQLEN,
            total_tokens=T,
        )

    def load(self, params):
        self.cu.copy_(params.cu_seqlens_q)
        if self.cu_padded is not None:
            self.cu_padded.copy_(params.cu_seqlens_q_padded)


def warm_up(fn, iters=3):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(iters):
            fn()
    torch.cuda.current_stream().wait_stream(side)


def capture_training_step(step, leaves):
    """``step()`` (a forward, and its backward into ``leaves``' ``.grad``) warmed up, then captured in one CUDA
    graph: ``(graph, static output, static grads)``. The grads are cleared first: allocated inside the capture, they
    become static outputs that each replay rewrites."""

    def clear_grads():
        for x in leaves:
            x.grad = None

    warm_up(lambda: (clear_grads(), step()))
    clear_grads()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    return graph, static_out, tuple(x.grad for x in leaves)


def replay_on(graph, static, params, bufs, *, no_sync=True):
    """Load ``params``' offsets into ``static`` and fresh values into ``bufs``, then replay ``graph``; with
    ``no_sync``, under ``set_sync_debug_mode("error")``, so a host read in the replayed work fails."""
    static.load(params)
    with torch.no_grad():
        for buf in bufs:
            buf.copy_(torch.randn_like(buf, dtype=torch.float32))
    if not no_sync:
        graph.replay()
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@DTYPE_PAD_PATHS
def test_graph_replay_forward_matches_eager(monkeypatch, dtype, pad, short_docs, report):
    cases = packings(30, seed=1 + pad, pad=pad)
    static = StaticParams(cases[0], pad)
    q, k, v = randn(T, HQ, D, dtype=dtype), randn(T, HKV, D, dtype=dtype), randn(T, HKV, D, dtype=dtype)
    if dtype == torch.bfloat16:
        assert_flash_path(q)
    if short_docs:
        static.params = use_short_docs(monkeypatch, q, k, static.params)
    with torch.no_grad():
        warm_up(lambda: rope_attention(q, k, v, static.params))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = rope_attention(q, k, v, static.params)

        worst, worst_ref = 0.0, 0.0
        for i, lengths in enumerate(cases):
            params = make_params(lengths, pad)
            static.load(params)
            for buf in (q, k, v):
                buf.copy_(torch.randn_like(buf, dtype=torch.float32))
            graph.replay()
            eager = rope_attention(q, k, v, params)
            diff = (static_out.float() - eager.float()).abs().max().item()
            worst = max(worst, diff)
            assert diff <= 1e-3, f"packing {i} {lengths}: replay vs eager max |diff| {diff}"
            assert_dead_rows_zero(static_out, live_rows(lengths, pad), f"packing {i}")
            if i % 6 == 0:  # and the replay is right, not just equal to eager
                cpu = params.to("cpu")
                ref_in = [x.double().cpu() for x in (q, k, v)]
                ref = rope_attention(*ref_in, cpu)
                worst_ref = max(worst_ref, rel_err(static_out, ref))
    tag = f"{str(dtype).removeprefix('torch.')}, {'padded' if pad > 1 else 'short-docs' if short_docs else 'plain'}"
    report(f"ops graph replay vs eager ({tag}): max |diff|", worst)
    report(f"ops graph replay vs eager ({tag}): packings", len(cases))
    report(f"ops graph replay vs fp64 ref ({tag}): max rel err", worst_ref)
    assert len(cases) >= 25
    assert worst_ref < 1e-2


@pytest.mark.parametrize("pad,short_docs", [(1, False), (8, False), (1, True)], ids=["plain", "padded8", "short-docs"])
def test_graph_replay_with_backward_matches_eager(monkeypatch, pad, short_docs, report):
    cases = packings(25, seed=100 + pad, pad=pad)
    static = StaticParams(cases[0], pad)
    q, k, v = (randn(T, h, D, requires_grad=True) for h in (HQ, HKV, HKV))
    weight = torch.randn(T, HQ, D, device=DEVICE)
    assert_flash_path(q)
    if short_docs:
        static.params = use_short_docs(monkeypatch, q, k, static.params)

    def step():
        out = rope_attention(q, k, v, static.params)
        (out.float() * weight).sum().backward()
        return out

    graph, static_out, static_grads = capture_training_step(step, (q, k, v))

    worst_out, worst_grad = 0.0, 0.0
    for i, lengths in enumerate(cases):
        params = make_params(lengths, pad)
        replay_on(graph, static, params, (q, k, v, weight), no_sync=False)

        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        eager = rope_attention(*leaves, params)
        eager_grads = torch.autograd.grad((eager.float() * weight).sum(), leaves)
        worst_out = max(worst_out, (static_out.float() - eager.float()).abs().max().item())
        live = live_rows(lengths, pad)
        for name, got, want in zip("qkv", static_grads, eager_grads, strict=True):
            # FA2's dq accumulates with float atomics: equal up to summation order, not bitwise.
            err = rel_err(got, want) if want.abs().max() > 0 else got.abs().max().item()
            worst_grad = max(worst_grad, err)
            assert err < 5e-3, f"packing {i} {lengths}: d{name} replay vs eager rel err {err}"
            assert_dead_rows_zero(got, live, f"packing {i} d{name}")
    tag = f"pad {pad}{', short-docs' if short_docs else ''}"
    report(f"ops graph fwd+bwd replay vs eager ({tag}): max |out diff|", worst_out)
    report(f"ops graph fwd+bwd replay vs eager ({tag}): max grad rel err", worst_grad)
    report(f"ops graph fwd+bwd replay vs eager ({tag}): packings", len(cases))
    assert worst_out <= 1e-3


# ------------------------------------------------------------------------------------------------ no host sync
@DTYPE_PAD_PATHS
def test_no_host_sync(monkeypatch, dtype, pad, short_docs):
    lengths = [5, 1, 0, 40, 17, 200]
    params = make_params(lengths, pad)  # host-to-device copies happen here, before the debug mode
    q, k, v = (randn(T, h, D, dtype=dtype, requires_grad=True) for h in (HQ, HKV, HKV))
    if short_docs:
        params = use_short_docs(monkeypatch, q, k, params)
    weight = torch.randn(T, HQ, D, device=DEVICE)
    position_ids = torch.arange(T, device=DEVICE)
    rope_attention(q, k, v, params)  # first call: signature detection, RoPE cache
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = rope_attention(q, k, v, params)
        out = out + varlen_attention(apply_rope_thd(q, params, position_ids=position_ids), k, v, params, causal=False)
        (out.float() * weight).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


# ------------------------------------------------------------------------------------------------ options (issue #32)
def needs_window_size():
    """FA2 takes a window from torch 2.11 (varlen_attn's window_size); torch 2.10 refuses it (tested below)."""
    api = attention_mod._torch_varlen_api()
    if api is None or api.causal_kw != "window_size":
        pytest.skip(f"torch {torch.__version__}: varlen_attn has no window_size")


def spy_flash(monkeypatch):
    """A list that each call of the FA2 path appends its window to (the tests check that they ran it, not the
    reference)."""
    calls = []
    flash = attention_mod._flash_attention

    def spied(*args, **kwargs):
        calls.append(kwargs.get("window"))
        return flash(*args, **kwargs)

    monkeypatch.setattr(attention_mod, "_flash_attention", spied)
    return calls


def bf16_weight(*shape):
    """A loss weight of bf16 values: the grad of a bf16 output is the weight rounded to bf16, so with these the
    float64 reference sees the same upstream grad and the comparison measures the attention alone."""
    return torch.randn(*shape, device=DEVICE).bfloat16().float()


def fwd_bwd(q, k, v, params, weight, sinks=None, **options):
    """Output and grads (q, k, v, and sinks when given) of ``(out.float() * weight).sum()``."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    sink_leaf = None if sinks is None else sinks.detach().clone().requires_grad_()
    out = varlen_attention(*leaves, params, sinks=sink_leaf, **options)
    wanted = leaves + ([] if sink_leaf is None else [sink_leaf])
    return out.detach(), torch.autograd.grad((out.float() * weight.to(out.device)).sum(), wanted)


def float64_reference(q, k, v, params, weight, sinks=None, **options):
    """The same on the CPU in float64 (the reference, checked against a per-document loop in tests/ops)."""
    cpu = [x.detach().double().cpu() for x in (q, k, v)]
    return fwd_bwd(
        *cpu, params.to("cpu"), weight.double().cpu(), None if sinks is None else sinks.double().cpu(), **options
    )


# (pad, causal, hkv, window, short_docs): causal windows, a diagonal-only one, non-causal and one-sided ones; with
# short_docs a window of at most 128 keys (every document in local blocks) and a longer one (one FA2 call too)
WINDOW_CASES = [
    (1, True, HQ, (16, 0), False),
    (1, True, HKV, (1, 0), False),
    (8, True, HKV, (100, 0), False),
    (1, False, HKV, (16, 8), False),
    (8, False, 1, (-1, 32), False),
    (4, False, HQ, (64, -1), False),
    (1, True, HKV, (16, 0), True),
    (1, True, HKV, (128, 0), True),
    (1, True, 1, (150, 0), True),
]


@pytest.mark.parametrize("pad,causal,hkv,window,short_docs", WINDOW_CASES)
def test_flash_window_matches_float64_reference(monkeypatch, pad, causal, hkv, window, short_docs, report):
    needs_window_size()
    lengths = [37, 1, 200, 0, 1, 64, 3, 1]
    params = make_params(lengths, pad)
    live = live_rows(lengths, pad)
    q, k, v = randn(T, HQ, D), randn(T, hkv, D), randn(T, hkv, D)
    assert_flash_path(q)
    if short_docs:
        params = use_short_docs(monkeypatch, q, k, params)
    weight = bf16_weight(T, HQ, D)
    flash_calls = spy_flash(monkeypatch)
    out, grads = fwd_bwd(q, k, v, params, weight, causal=causal, window=window)
    assert flash_calls == [(window[0], 0) if causal else window], flash_calls
    ref_out, ref_grads = float64_reference(q, k, v, params, weight, causal=causal, window=window)
    errors = {"out": rel_err(out, ref_out)}
    errors.update({f"d{n}": rel_err(g, r) for n, g, r in zip("qkv", grads, ref_grads, strict=True)})
    tag = f"pad{pad} {'causal' if causal else 'full'} hkv{hkv} window={window}{' short-docs' if short_docs else ''}"
    report(f"FA2 window bf16 vs fp64 ref ({tag}): max rel err", max(errors.values()))
    for name, err in errors.items():
        assert err < 1e-2, f"{name}: relative error {err:.3g} ({tag})"
    for name, t in zip(("out", "dq", "dk", "dv"), (out, *grads), strict=True):
        assert not t.isnan().any(), name
        assert_dead_rows_zero(t, live, name)
    # and the window does something here: it differs from the attention without it
    assert rel_err(out, float64_reference(q, k, v, params, weight, causal=causal)[0]) > 1e-2


def test_window_needs_torch_2_11_on_the_flash_path():
    api = attention_mod._torch_varlen_api()
    if api is not None and api.causal_kw == "window_size":
        pytest.skip(f"torch {torch.__version__} takes window_size")
    params = make_params([37, 5], 1)
    q = randn(T, HQ, D)
    with pytest.raises(NotImplementedError, match=r"torch >= 2\.11"):
        varlen_attention(q, q, q, params, window=(16, 0))


@pytest.mark.parametrize("window,short_docs", [((16, 0), False), ((8, 8), False), ((32, 0), True), ((200, 0), True)])
def test_graph_replay_with_window_matches_eager_and_float64(monkeypatch, window, short_docs, report):
    """Forward and backward of a windowed FA2 call captured once, replayed on new packings: eager's values (up to
    FA2's atomic dq sums) and the float64 reference's, dead rows zero, no host sync at replay."""
    needs_window_size()
    pad = 1
    causal = window[1] == 0
    cases = packings(16, seed=200 + window[0], pad=pad)
    static = StaticParams(cases[0], pad)
    q, k, v = (randn(T, h, D, requires_grad=True) for h in (HQ, HKV, HKV))
    weight = bf16_weight(T, HQ, D)
    assert_flash_path(q)
    if short_docs:
        static.params = use_short_docs(monkeypatch, q, k, static.params)
    flash_calls = spy_flash(monkeypatch)

    def step():
        out = varlen_attention(q, k, v, static.params, causal=causal, window=window)
        (out.float() * weight).sum().backward()
        return out

    graph, static_out, static_grads = capture_training_step(step, (q, k, v))
    assert flash_calls and set(flash_calls) == {window}, flash_calls

    worst_eager, worst_ref = 0.0, 0.0
    for i, lengths in enumerate(cases):
        params = make_params(lengths, pad)
        replay_on(graph, static, params, (q, k, v))
        eager_out, eager_grads = fwd_bwd(q, k, v, params, weight, causal=causal, window=window)
        live = live_rows(lengths, pad)
        for name, got, want in zip(
            ("out", "dq", "dk", "dv"), (static_out, *static_grads), (eager_out, *eager_grads), strict=True
        ):
            err = rel_err(got, want) if want.abs().max() > 0 else got.abs().max().item()
            worst_eager = max(worst_eager, err)
            assert err < 5e-3, f"packing {i} {lengths}: {name} replay vs eager rel err {err}"
            assert_dead_rows_zero(got, live, f"packing {i} {name}")
        if i % 4 == 0:
            ref_out, ref_grads = float64_reference(q, k, v, params, weight, causal=causal, window=window)
            for got, want in zip((static_out, *static_grads), (ref_out, *ref_grads), strict=True):
                if want.abs().max() > 0:
                    worst_ref = max(worst_ref, rel_err(got, want))
    tag = f"window={window}{' short-docs' if short_docs else ''}"
    report(f"ops graph fwd+bwd replay vs eager ({tag}): max rel err", worst_eager)
    report(f"ops graph fwd+bwd replay vs fp64 ref ({tag}): max rel err", worst_ref)
    assert worst_ref < 1e-2


SOFTCAP_SINKS_CASES = [
    (torch.bfloat16, dict(softcap=5.0)),
    (torch.bfloat16, dict(sinks=True)),
    (torch.bfloat16, dict(sinks=True, window=(16, 0))),
    (torch.bfloat16, dict(softcap=2.0, sinks=True, window=(8, 8), causal=False)),
    (torch.float32, dict(softcap=5.0, sinks=True, window=(32, 0))),
]


@pytest.mark.parametrize("pad", [1, 8])
@pytest.mark.parametrize("dtype,options", SOFTCAP_SINKS_CASES)
def test_softcap_and_sinks_match_float64(dtype, options, pad, report):
    """softcap and sinks run the reference on CUDA (FA2 in torch has neither): against float64 on the CPU, grads of
    the sinks included; dead rows zero."""
    options = dict(options)
    lengths = [37, 1, 200, 0, 1, 64, 3, 1]
    params = make_params(lengths, pad)
    live = live_rows(lengths, pad)
    q, k, v = (randn(T, h, D, dtype=dtype) * 2 for h in (HQ, HKV, HKV))
    sinks = torch.randn(HQ, device=DEVICE) if options.pop("sinks", False) else None
    weight = bf16_weight(T, HQ, D)
    out, grads = fwd_bwd(q, k, v, params, weight, sinks, **options)
    ref_out, ref_grads = float64_reference(q, k, v, params, weight, sinks, **options)
    names = ["out", "dq", "dk", "dv", "dsinks"]
    errors = {name: rel_err(g, r) for name, g, r in zip(names, (out, *grads), (ref_out, *ref_grads), strict=False)}
    tag = f"{str(dtype).removeprefix('torch.')} pad{pad} {options} sinks={sinks is not None}"
    report(f"softcap/sinks on CUDA vs fp64 ({tag}): max rel err", max(errors.values()))
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    for name, err in errors.items():
        assert err < tol, f"{name}: relative error {err:.3g} ({tag})"
    for name, t in zip(names[:4], (out, *grads[:3]), strict=True):
        assert_dead_rows_zero(t, live, name)


def test_softcap_sinks_window_replay_in_a_graph_without_host_sync():
    """The reference path with every option is graph-safe: captured forward and backward (sinks' grad included)
    replay on new offsets with eager's values."""
    pad = 1
    cases = packings(6, seed=300, pad=pad)
    static = StaticParams(cases[0], pad)
    q, k, v = (randn(T, h, D, requires_grad=True) for h in (HQ, HKV, HKV))
    sinks = torch.randn(HQ, device=DEVICE, requires_grad=True)
    weight = bf16_weight(T, HQ, D)
    options = dict(window=(16, 0), softcap=5.0)

    def step():
        out = varlen_attention(q, k, v, static.params, sinks=sinks, **options)
        (out.float() * weight).sum().backward()
        return out

    graph, static_out, static_grads = capture_training_step(step, (q, k, v, sinks))
    for i, lengths in enumerate(cases):
        params = make_params(lengths, pad)
        replay_on(graph, static, params, (q, k, v))
        eager_out, eager_grads = fwd_bwd(q, k, v, params, weight, sinks, **options)
        for name, got, want in zip(
            ("out", "dq", "dk", "dv", "dsinks"), (static_out, *static_grads), (eager_out, *eager_grads), strict=True
        ):
            # the same kernels on the same values: equal up to the order of float sums
            err = rel_err(got, want) if want.abs().max() > 0 else got.abs().max().item()
            assert err < 1e-3, f"packing {i} {lengths}: {name} replay vs eager rel err {err}"
