"""GPU checks of the THD ops: FA2 varlen path vs the float64 reference, raw CUDA-graph replay vs eager over many
packings (forward, and backward inside the capture), and no host sync under ``set_sync_debug_mode("error")``.

Every test here is marked ``cuda`` by tests/conftest.py and skipped without a GPU.
"""

import random

import pytest
import torch

from packgraph import PackedSeqParams, slot_boundary
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
    """Route these offsets through packgraph.ops.short_docs (local blocks + one FA2 call on the long documents)
    although their capacity is below SHORT_DOCS_MIN_SLOTS, and check that it applies."""
    monkeypatch.setattr(slot_boundary, "SHORT_DOCS_MIN_SLOTS", 1)
    assert attention_mod._short_docs_apply(q, k, params, True)


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
        use_short_docs(monkeypatch, q, k, params)
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


@DTYPE_PAD_PATHS
def test_graph_replay_forward_matches_eager(monkeypatch, dtype, pad, short_docs, report):
    cases = packings(30, seed=1 + pad, pad=pad)
    static = StaticParams(cases[0], pad)
    q, k, v = randn(T, HQ, D, dtype=dtype), randn(T, HKV, D, dtype=dtype), randn(T, HKV, D, dtype=dtype)
    if dtype == torch.bfloat16:
        assert_flash_path(q)
    if short_docs:
        use_short_docs(monkeypatch, q, k, static.params)
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
        use_short_docs(monkeypatch, q, k, static.params)

    def step():
        out = rope_attention(q, k, v, static.params)
        (out.float() * weight).sum().backward()
        return out

    def clear_grads():
        for x in (q, k, v):
            x.grad = None

    warm_up(lambda: (clear_grads(), step()))
    clear_grads()  # grads allocated inside the capture become static outputs that each replay rewrites
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    static_grads = (q.grad, k.grad, v.grad)

    worst_out, worst_grad = 0.0, 0.0
    for i, lengths in enumerate(cases):
        params = make_params(lengths, pad)
        static.load(params)
        with torch.no_grad():
            for buf in (q, k, v):
                buf.copy_(torch.randn_like(buf, dtype=torch.float32))
            weight.copy_(torch.randn_like(weight))
        graph.replay()

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
        use_short_docs(monkeypatch, q, k, params)
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
