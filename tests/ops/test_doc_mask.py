"""Document-mask attention (FlexAttention with a block mask built from the offsets) against the exact reference,
forward only: torch's FlexAttention has no backward on the CPU (tests/cuda/test_doc_mask_cuda.py has the grads and
the CUDA graph). Also as ``varlen_attention``'s ``"doc_mask"`` backend, in a GPT, and its one-bucket policy."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import packgraph.ops.doc_mask as doc_mask_mod
from packgraph.ops.attention import varlen_attention_reference
from packgraph.ops.doc_mask import default_tiles, doc_mask_attention, document_block_mask
from packgraph.params import PackedSeqParams

T, D = 80, 16
LAYOUTS = {
    "plain": dict(lengths=[5, 17, 1, 9, 12, 26], capacity=8),  # two ghost slots, a dead tail of 10 rows
    "one-document": dict(lengths=[80], capacity=1),
    "padded": dict(lengths=[5, 17, 1, 9, 12, 20], capacity=8, pad_to_multiple=4),  # each document padded to 4
}


def _case(layout: str, hq: int, hkv: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    spec = dict(LAYOUTS[layout])
    params = PackedSeqParams.from_seqlens(spec.pop("lengths"), total_tokens=T, max_seqlen=80, **spec)
    q, k, v = (torch.randn(T, h, D, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv))
    return q, k, v, params


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(causal=False),
        dict(window=(7, 0)),
        dict(causal=False, window=(3, 5)),
        dict(softcap=2.0),
        dict(softmax_scale=0.3, window=(2, 0), softcap=5.0),
    ],  # fmt: skip
    ids=["causal", "full", "window", "two-sided-window", "softcap", "all"],
)
def test_equals_the_reference(layout, heads, options):
    q, k, v, params = _case(layout, *heads)
    want = varlen_attention_reference(q, k, v, params, **options)
    with torch.no_grad():
        got = doc_mask_attention(q, k, v, params, **options)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("block_size", [16, 64])
def test_a_mask_of_other_block_sizes_gives_the_same_values(block_size):
    """The block size changes which blocks the kernel skips, never which pairs it attends: the reference's values,
    in every layout (T=80 is no multiple of 64: the last block is partial)."""
    for layout in LAYOUTS:
        q, k, v, params = _case(layout, 4, 2)
        mask = document_block_mask(params, T, torch.device("cpu"), window=(7, 0), block_size=block_size)
        assert tuple(mask[0].BLOCK_SIZE) == (block_size, block_size)
        with torch.no_grad():
            got = doc_mask_attention(q, k, v, params, window=(7, 0), mask=mask)
        want = varlen_attention_reference(q, k, v, params, window=(7, 0))
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=layout)


def test_dead_rows_are_exact_zeros_and_no_other_document_leaks_in():
    q, k, v, params = _case("padded", 4, 2)
    live = torch.zeros(T, dtype=torch.bool)
    starts, lengths = params.cu_seqlens_q_padded.tolist(), params.cu_seqlens_q.diff().tolist()
    for start, n in zip(starts, lengths, strict=False):
        live[start : start + n] = True
    poisoned = [t.clone() for t in (q, k, v)]
    for t in poisoned:
        t[~live] = float("nan")  # what a dead row holds must not matter
    with torch.no_grad():
        got = doc_mask_attention(*poisoned, params)
    assert torch.equal(got[~live], torch.zeros_like(got[~live]))
    torch.testing.assert_close(got[live], varlen_attention_reference(q, k, v, params)[live], rtol=1e-10, atol=1e-12)


class _HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_block_mask_is_built_without_a_host_read():
    """What runs around the kernel: the rows' documents and the block mask (FlexAttention's own op is a higher-order
    op that a dispatch mode cannot enter)."""
    _, _, _, params = _case("padded", 4, 2)
    with torch.no_grad(), _HostReads() as mode:
        block_mask, live = document_block_mask(params, T, torch.device("cpu"), window=(7, 0))
    assert mode.reads == []
    assert int(live.sum()) == int(params.cu_seqlens_q[-1])


def test_compiled_equals_eager_and_compiles_once_for_every_packing():
    """``compiled=True`` (the backend's CUDA mode; Inductor's CPU template here) gives the eager values, and a new
    packing of the same shape compiles nothing: the rows' documents enter the block mask's closure as tensors, which
    dynamo takes as inputs, not as constants to guard on."""
    from torch._dynamo.utils import counters

    total = 256
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, h, 32, generator=g) for h in (4, 2, 2))
    compiles = None
    layouts = [dict(lengths=[100, 50]), dict(lengths=[10, 20, 30, 40], pad_to_multiple=8), dict(lengths=[256])]
    for spec in [*layouts, dict(lengths=[1] * 200)]:
        spec = dict(spec)
        params = PackedSeqParams.from_seqlens(spec.pop("lengths"), capacity=total, total_tokens=total, **spec)
        for options in (dict(), dict(window=(9, 0), softcap=3.0)):
            with torch.no_grad():
                got = doc_mask_attention(q, k, v, params, compiled=True, **options)
                want = doc_mask_attention(q, k, v, params, **options)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{spec} {options}")
        if compiles is None:
            compiles = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == compiles


def test_kernel_options_reach_flex_attention_and_autotune_gives_the_same_values(monkeypatch):
    """``kernel_options`` are FlexAttention's own (tiles, warps): passed through untouched, and compiled with them,
    or with ``autotune``, the values are eager's (only the kernel's schedule changes)."""
    import torch.nn.attention.flex_attention as flex

    q, k, v, params = _case("padded", 4, 2)
    q, k, v = (x.float() for x in (q, k, v))  # Inductor's CPU template takes no float64
    options = {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64}
    seen, real = [], flex.flex_attention
    monkeypatch.setattr(flex, "flex_attention", lambda *a, **kw: seen.append(kw["kernel_options"]) or real(*a, **kw))
    with torch.no_grad():
        want = doc_mask_attention(q, k, v, params)
        doc_mask_attention(q, k, v, params, kernel_options=options)
        doc_mask_attention(q, k, v, params, kernel_options={})
        # With none given, the kernel runs default_tiles' choice (the CPU's: Inductor's default, None)
        monkeypatch.setattr(doc_mask_mod, "default_tiles", lambda q: {"fwd_num_warps": 2})
        doc_mask_attention(q, k, v, params)
    assert seen == [None, options, {}, {"fwd_num_warps": 2}]
    assert default_tiles(q) is None
    monkeypatch.setattr(flex, "flex_attention", real)
    with torch.no_grad():
        for extra in (dict(kernel_options=options), dict(autotune=True)):
            got = doc_mask_attention(q, k, v, params, compiled=True, **extra)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(extra))


def test_inside_a_callers_compile_the_graph_breaks_once_and_the_values_are_eager(monkeypatch):
    """A block or a whole model compiled around the compiled document mask (``packgraph+compile`` on this backend):
    the caller's graph breaks once, where the mask is built (Inductor fails to lower the rows' documents as
    intermediates of the graph that reads them), the values are eager's, and a new packing compiles nothing."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    total = 256
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(total, h, 16, generator=g) for h in (4, 2, 2))
    w = torch.randn(16, 16, generator=g)

    def block(q, k, v, params, compiled):
        return doc_mask_attention(q @ w, k, v, params, compiled=compiled, window=(31, 0)).sin()

    packings = [
        PackedSeqParams.from_seqlens(lengths, capacity=total, total_tokens=total)
        for lengths in ([100, 50], [30, 30, 30, 10], [256])
    ]
    with torch.no_grad():
        wants = [block(q, k, v, params, False) for params in packings]  # eager FlexAttention traces too: first
    torch._dynamo.reset()
    counters.clear()
    compiled_block = torch.compile(block)
    graphs = None
    for params, want in zip(packings, wants, strict=True):
        with torch.no_grad():
            got = compiled_block(q, k, v, params, True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        graphs = graphs or counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs
    breaks = list(counters["graph_break"])
    assert len(breaks) == 1 and "_compiled_mask" in breaks[0], breaks


def test_with_the_mask_built_ahead_a_callers_compile_traces_the_attention_into_its_graph():
    """Given the mask built ahead (the GPT builds it once per forward), the compiled document mask inside a caller's
    torch.compile is part of the caller's graph, with no break: the zeroing and layout copies around FlexAttention
    fuse with the layer's other kernels. Values as eager's; a new packing (a new mask) compiles nothing."""
    from torch._dynamo.utils import counters

    total = 256
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(total, h, 16, generator=g) for h in (4, 2, 2))
    w = torch.randn(16, 16, generator=g)

    def block(q, k, v, params, mask):
        return doc_mask_attention(q @ w, k, v, params, compiled=True, softcap=5.0, mask=mask).sin()

    cpu = torch.device("cpu")
    packings = [
        PackedSeqParams.from_seqlens(lengths, capacity=total, total_tokens=total, pad_to_multiple=8)
        for lengths in ([100, 50], [30, 30, 30, 10], [256])
    ]
    masks = [document_block_mask(params, total, cpu, compiled=True) for params in packings]
    with torch.no_grad():
        explained = torch._dynamo.explain(block)(q, k, v, packings[0], masks[0])
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        targets = {str(n.target) for n in explained.graphs[0].graph.nodes if n.op == "call_function"}
        assert any("flex_attention" in t for t in targets), targets
        wants = [block(q, k, v, params, mask) for params, mask in zip(packings, masks, strict=True)]
        torch._dynamo.reset()  # eager FlexAttention traces too: it runs before the count starts
        counters.clear()
        compiled_block = torch.compile(block)
        for params, mask, want in zip(packings, masks, wants, strict=True):
            torch.testing.assert_close(compiled_block(q, k, v, params, mask), want, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_refuses_cross_attention_by_name():
    q, k, v, params = _case("plain", 4, 2)
    with pytest.raises(ValueError, match="use varlen_attention"):
        doc_mask_attention(q[:40], k, v, params)


# ---------------------------------------------------------------------------------------------------- as a backend
def _count_doc_mask_calls(monkeypatch) -> list:
    import packgraph.ops.attention as attention

    calls, real = [], attention.doc_mask_attention
    monkeypatch.setattr(attention, "doc_mask_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    return calls


def test_varlen_attention_backend_doc_mask_equals_the_flash_backend(monkeypatch):
    """``varlen_attention(..., backend="doc_mask")`` against the default backend (the reference on the CPU), with
    the options it takes; the window goes through varlen_attention's own checks first (causal makes its right 0)."""
    from packgraph.ops import varlen_attention

    calls = _count_doc_mask_calls(monkeypatch)
    q, k, v, params = _case("padded", 4, 2)
    for options in (dict(), dict(window=(7, 3)), dict(causal=False, window=(3, 5), softcap=4.0)):
        with torch.no_grad():
            got = varlen_attention(q, k, v, params, backend="doc_mask", **options)
            want = varlen_attention(q, k, v, params, **options)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=str(options))
    assert len(calls) == 3 and calls[1]["window"] == (7, 0)


def test_the_backend_refuses_what_it_cannot_run_by_name():
    from packgraph.ops import varlen_attention

    q, k, v, params = _case("plain", 4, 2)
    with pytest.raises(ValueError, match="backend must be one of"):
        varlen_attention(q, k, v, params, backend="cudnn")
    with pytest.raises(ValueError, match="choose_attention_backend"):
        varlen_attention(q, k, v, params, backend="auto")
    with pytest.raises(NotImplementedError, match="no attention sinks; use backend='flash'"):
        varlen_attention(q, k, v, params, backend="doc_mask", sinks=torch.zeros(4, dtype=q.dtype))
    separate = params.replace(cu_seqlens_kv=params.cu_seqlens_q.clone())  # equal values, another tensor
    with pytest.raises(ValueError, match="same cu_seqlens tensor"):
        varlen_attention(q, k, v, separate, backend="doc_mask")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with pytest.raises(NotImplementedError, match="forward passes only on the CPU"):
        varlen_attention(*leaves, params, backend="doc_mask")


def test_document_mask_buckets_put_every_packing_in_one_bucket():
    """No rung for FlashAttention's kernel switch (the document mask has none): batches of 1 to T documents, of
    any length, share one bucket, hence one graph per layer."""
    from packgraph.buckets import BucketPolicy, default_buckets, document_mask_buckets

    policy = document_mask_buckets(T)
    assert policy.num_buckets == 1 and policy.capacity_ladder == (T,) and not policy.flash_kernels
    buckets = set()
    for lengths in ([80], [1] * 80, [5, 17, 1, 9, 12, 26], [40, 40], [3, 0, 0, 5]):
        params = PackedSeqParams.from_seqlens(lengths, total_tokens=T, max_seqlen=80)
        bucketed = policy.apply(params)
        assert bucketed.capacity == T and bucketed.max_seqlen_q == T
        buckets.add(policy.bucket_of(params))
    assert len(buckets) == 1
    assert BucketPolicy((256,), (512,)).capacity_ladder == (128, 512)  # FlashAttention's switch gets its rung
    assert default_buckets(T).num_buckets > 1
    with pytest.raises(ValueError, match="total_tokens must be >= 1"):
        document_mask_buckets(0)


def test_a_gpt_on_the_doc_mask_backend_equals_the_flash_backend(monkeypatch):
    """The GPT builds the document mask once per forward and every layer reads it (a mask of its own per layer gave
    the same values at one build per layer); the values are the FA2 backend's."""
    import packgraph.models.gpt as gpt
    from packgraph.models.gpt import GPT, GPTConfig

    calls = _count_doc_mask_calls(monkeypatch)
    builds, build = [], gpt.document_block_mask
    monkeypatch.setattr(gpt, "document_block_mask", lambda *a, **kw: builds.append(kw) or build(*a, **kw))
    cfg = dict(vocab_size=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32)
    flash = GPT(GPTConfig(**cfg)).double()
    doc_mask = GPT(GPTConfig(**cfg, attention_backend="doc_mask")).double()
    doc_mask.load_state_dict(flash.state_dict())
    _, _, _, params = _case("padded", 4, 2)
    tokens = torch.randint(0, 32, (T,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(doc_mask(tokens, params), flash(tokens, params), rtol=1e-10, atol=1e-12)
    assert len(calls) == 2 and len(builds) == 1  # one attention per layer, one mask per forward
    assert all(call["mask"] is not None for call in calls)
    x = doc_mask.embed_tokens(tokens)
    with torch.no_grad():  # each layer building its own mask, as varlen_attention does by default
        for block in doc_mask.blocks:
            x = block(x, params)
        torch.testing.assert_close(doc_mask.forward_hidden(tokens, params), x, rtol=0, atol=0)
    q, k, v, _ = _case("padded", 4, 2)
    from packgraph.ops import varlen_attention

    with pytest.raises(ValueError, match="FA2 takes none"):
        varlen_attention(q, k, v, params, mask=document_block_mask(params, T, q.device))
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        GPTConfig(**cfg, attention_backend="sdpa")
