"""Document-mask attention (``packgraph.ops.doc_mask``, FlexAttention) on CUDA: forward and backward against the
float64 reference, and one CUDA graph serving packings of every document count (issue #36).

FlexAttention runs compiled here, as the backend runs it (``compiled=True``: the block mask's build and the
attention compiled apart), warmed up before the capture, so the graph records the fused kernels. The packings are
those of tests/cuda/test_ops_cuda.py (long and 1-token documents, zero-length ones, ghost slots, no document at
all), and those of the attention benchmark.
"""

import functools
import math

import pytest
import torch

from packgraph.ops.doc_mask import doc_mask_attention, document_block_mask
from tests.cuda.test_ops_cuda import (
    HKV,
    HQ,
    D,
    StaticParams,
    T,
    bf16_weight,
    capture_training_step,
    float64_reference,
    live_rows,
    make_params,
    packings,
    randn,
    rel_err,
    replay_on,
)

TOL = 2e-2  # bf16 against float64, relative over the whole tensor
OPTIONS = [dict(), dict(window=(63, 0)), dict(softcap=20.0), dict(causal=False, window=(15, 15))]


NAMES = ("out", "dq", "dk", "dv")


def _errors(got, want, where: str) -> list[tuple[float, str]]:
    """``(relative error, label)`` per tensor; a NaN counts as infinite (``max`` would pass it over). Against a
    zero reference the error is absolute: a packing with no document, or one of one-token documents, whose ``dq``
    and ``dk`` are zeros (the float64 reference leaves ~1e-15 of rounding there, the bf16 kernels their own noise)."""
    out = []
    for name, g, w in zip(NAMES[: len(got)], got, want, strict=True):
        err = rel_err(g, w) if w.abs().max() > 1e-10 else g.detach().double().abs().max().item()
        out.append((float("inf") if err != err else err, f"{where} {name}"))
    return out


def _fwd_bwd(fn, q, k, v, params, weight, **options):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves, params, **options)
    return out.detach(), torch.autograd.grad((out.float() * weight).sum(), leaves)


@pytest.mark.parametrize("options", OPTIONS, ids=["causal", "window", "softcap", "two-sided"])
@pytest.mark.parametrize("pad", [1, 8])
def test_matches_float64_reference_with_grads(options, pad, report):
    compiled = functools.partial(doc_mask_attention, compiled=True)
    errors = []
    for i, lengths in enumerate(packings(6, seed=7, pad=pad)):
        params = make_params(lengths, pad)
        q, k, v = (randn(T, h, D) for h in (HQ, HKV, HKV))
        weight = bf16_weight(T, HQ, D)
        out, grads = _fwd_bwd(compiled, q, k, v, params, weight, **options)
        want_out, want_grads = float64_reference(q, k, v, params, weight, **options)
        live = live_rows(lengths, pad)
        assert torch.equal(out[~live], torch.zeros_like(out[~live])), "dead rows must be exact zeros"
        errors += _errors((out, *grads), (want_out, *want_grads), f"packing {i} ({len(lengths)} docs)")
    worst, where = max(errors)
    report(f"doc_mask {options or 'causal'} pad={pad}: worst err vs float64 ({where})", f"{worst:.2e}")
    assert worst <= TOL, sorted(errors, reverse=True)[:6]


@pytest.mark.parametrize(
    "tiles",
    ["Inductor default", "fwd 64x64 w4 s3, bwd 64x64 w4 s3", "autotune"],
)
def test_other_kernel_tiles_match_float64_reference_with_grads(tiles, report):
    """The choices a caller has besides packgraph's default tiles (which every other test here runs): Inductor's
    default (``kernel_options={}``), backward tiles of the caller's own (``bwd_BLOCK_*``), and max-autotune's
    choice. Only the schedule changes: outputs, grads and dead rows as
    with the default."""
    from packgraph.bench.backends import FLEX_TILES

    options = dict(FLEX_TILES[tiles])
    block_size = options.pop("block_size", 128)

    def compiled(q, k, v, params):
        mask = document_block_mask(params, q.shape[0], q.device, compiled=True, block_size=block_size)
        return doc_mask_attention(q, k, v, params, compiled=True, mask=mask, **options)

    errors = []
    for i, lengths in enumerate(packings(3, seed=11, pad=1)):
        params = make_params(lengths, 1)
        q, k, v = (randn(T, h, D) for h in (HQ, HKV, HKV))
        weight = bf16_weight(T, HQ, D)
        out, grads = _fwd_bwd(compiled, q, k, v, params, weight)
        want_out, want_grads = float64_reference(q, k, v, params, weight)
        live = live_rows(lengths, 1)
        assert torch.equal(out[~live], torch.zeros_like(out[~live])), "dead rows must be exact zeros"
        errors += _errors((out, *grads), (want_out, *want_grads), f"packing {i} ({len(lengths)} docs)")
    worst, where = max(errors)
    report(f"doc_mask tiles [{tiles}]: worst err vs float64 ({where})", f"{worst:.2e}")
    assert worst <= TOL, sorted(errors, reverse=True)[:6]


def test_default_tiles_are_the_measured_tiles_on_sm90():
    """With no ``kernel_options``, the kernel runs :func:`default_tiles`: on sm90 in bf16 the tiles of the H200
    studies (forward, TMA forward loads and backward at head size 64, forward at 128), bit for bit the call given
    them explicitly; elsewhere Inductor's default."""
    from packgraph.bench.backends import FLEX_TILES
    from packgraph.ops.doc_mask import default_tiles

    sm90 = torch.cuda.get_device_capability() == (9, 0)
    measured = {
        64: FLEX_TILES["fwd 64x64 w4 s3 TMA, bwd 64x64 w4 s3"]["kernel_options"],
        128: FLEX_TILES["fwd 64x64 w4 s3"]["kernel_options"],
    }
    for head_dim in (64, 128, 96):
        q = randn(T, HQ, head_dim)
        want = measured.get(head_dim) if sm90 else None
        assert default_tiles(q) == want, (head_dim, default_tiles(q))
    assert default_tiles(randn(T, HQ, 64).float()) is None
    lengths = packings(1, seed=5, pad=1)[0]
    params = make_params(lengths, 1)
    q, k, v = (randn(T, h, D) for h in (HQ, HKV, HKV))
    weight = bf16_weight(T, HQ, D)
    got = _fwd_bwd(functools.partial(doc_mask_attention, compiled=True), q, k, v, params, weight)
    explicit = functools.partial(doc_mask_attention, compiled=True, kernel_options=default_tiles(q) or {})
    want = _fwd_bwd(explicit, q, k, v, params, weight)
    for a, b in zip((got[0], *got[1]), (want[0], *want[1]), strict=True):
        assert torch.equal(a, b)


def test_one_graph_serves_every_packing(report):
    """Captured once on one packing, replayed on packings of other document counts and lengths: eager's values.
    No ``max_seqlen`` or capacity enters the kernel, so no packing needs another graph."""
    pad = 1
    cases = packings(8, seed=11, pad=pad)
    static = StaticParams(cases[0], pad)
    compiled = functools.partial(doc_mask_attention, compiled=True)
    q, k, v = (randn(T, h, D, requires_grad=True) for h in (HQ, HKV, HKV))
    weight = bf16_weight(T, HQ, D)

    def step():
        out = compiled(q, k, v, static.params)
        (out.float() * weight).sum().backward()
        return out

    graph, static_out, grads = capture_training_step(step, (q, k, v))
    errors = []
    for i, lengths in enumerate(cases):
        params = make_params(lengths, pad)
        replay_on(graph, static, params, (q, k, v))
        want_out, want_grads = _fwd_bwd(compiled, q, k, v, params, weight)
        errors += _errors((static_out, *grads), (want_out, *want_grads), f"packing {i} ({len(lengths)} docs)")
    worst, where = max(errors)
    report(f"doc_mask: one graph over 8 packings, worst err vs the compiled call ({where})", f"{worst:.2e}")
    assert worst <= 1e-2, sorted(errors, reverse=True)[:6]


@pytest.mark.parametrize("scope", ["layer", "attn"])
def test_a_graphed_gpt_on_the_doc_mask_backend_needs_one_graph_per_layer(scope, report):
    """A GPT with ``attention_backend="doc_mask"``, graphed under ``document_mask_buckets(T)``, over the packings of
    test_gpt_cuda (corpus batches of several FlashAttention buckets, a padded layout, a full bin, 1-token
    documents): one graph set for all of them, and the losses and grads of the same model run eagerly."""
    from packgraph.buckets import document_mask_buckets
    from packgraph.models.gpt import GPT, GPTConfig
    from tests.cuda.test_gpt_cuda import GRAD_RTOL, LOSS_ATOL, loss_and_grads, packings
    from tests.cuda.test_gpt_cuda import T as GPT_T

    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny", d_model=128, n_layer=3, n_head=4, n_kv_head=2, attention_backend="doc_mask")
    model = GPT(cfg).cuda()
    graphed = model.graphed(scope=scope, buckets=document_mask_buckets(GPT_T))
    worst_loss = worst_grad = 0.0
    batches = packings()
    for batch in batches:
        batch = batch.to("cuda")
        eager_loss, eager_grads = loss_and_grads(model, model, batch)
        g_loss, g_grads = loss_and_grads(model, graphed, batch)
        assert torch.isfinite(g_loss)
        worst_loss = max(worst_loss, float((g_loss - eager_loss).abs()))
        for name, e in eager_grads.items():
            scale = float(e.abs().max()) + 1e-6
            worst_grad = max(worst_grad, float((g_grads[name] - e).abs().max()) / scale)
    report(f"doc_mask GPT graphed[{scope}] vs eager over {len(batches)} packings: max |loss diff|", worst_loss)
    report(f"doc_mask GPT graphed[{scope}] vs eager: max grad diff / max |grad|", worst_grad)
    report(f"doc_mask GPT graphed[{scope}]: graph sets", graphed.num_graph_sets)
    assert worst_loss <= LOSS_ATOL and worst_grad <= GRAD_RTOL
    assert graphed.num_graph_sets == 1


@pytest.mark.parametrize("pad", [1, 8])
def test_no_host_sync(pad):
    """After the first call of a shape (which compiles), forward and backward through ``varlen_attention(backend=
    "doc_mask")`` make no synchronizing CUDA call, windows and softcapping included (torch's sync debug mode)."""
    from packgraph.ops import varlen_attention

    params = make_params(packings(1, seed=3, pad=pad)[0], pad)  # host-to-device copies here, before the mode
    q, k, v = (randn(T, h, D, requires_grad=True) for h in (HQ, HKV, HKV))
    weight = bf16_weight(T, HQ, D)

    def step():
        out = varlen_attention(q, k, v, params, backend="doc_mask", window=(63, 0), softcap=20.0)
        (out.float() * weight).sum().backward()

    step()  # compiles
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def test_choose_attention_backend_measures_both_and_returns_the_policy_of_its_choice(report, tmp_path):
    """``choose_attention_backend`` on this GPU: both backends timed, the smaller sum chosen, its own bucket policy;
    and ``packgraph train --attention-backend auto`` trains on the backend it names, graphed, losses finite."""
    from packgraph.backend_choice import choose_attention_backend
    from packgraph.buckets import default_buckets, document_mask_buckets
    from packgraph.train import TrainConfig, train

    choice = choose_attention_backend(2048, 8, 4, 64, device="cuda", reps=5)
    assert set(choice.times_ms) == {"flash", "doc_mask"} and all(ms > 0 for ms in choice.times_ms.values())
    assert choice.backend == min(choice.times_ms, key=choice.times_ms.__getitem__)
    want = {"flash": default_buckets, "doc_mask": document_mask_buckets}[choice.backend](2048)
    assert choice.policy == want
    report("auto backend at T=2048, 8/4 heads of 64: ms flash / doc_mask", choice.times_ms)

    lines = []
    cfg = TrainConfig(T=1024, steps=4, attention_backend="auto", graphs=True, device="cuda", out_dir=str(tmp_path),
                      progress=False, plot=False, max_docs=200)  # fmt: skip
    result = train(cfg, echo=lines.append)
    chosen = [line for line in lines if line.startswith("attention backend: ")]
    assert len(chosen) == 1, lines
    backend = chosen[0].split()[2]
    assert backend in ("flash", "doc_mask")
    assert len(result.losses) == 4 and all(math.isfinite(x) for x in result.losses)


def test_deterministic_training_on_the_doc_mask_backend_is_bitwise_eager_or_refused(tmp_path, report):
    """``packgraph train --attention-backend doc_mask`` under deterministic kernels: graphed-layer losses equal
    eager's bit for bit over 15 steps (the graphs replay the same compiled kernels), or torch refuses FlexAttention
    under deterministic algorithms by name, eagerly as well as graphed."""
    from packgraph.train import train
    from tests.cuda.test_gpt_cuda import tiny_run

    runs, errors = {}, {}
    for name, overrides in (("eager", {"graphs": False}), ("graphed-layer", {"graphs": True, "scope": "layer"})):
        cfg = tiny_run(tmp_path / name, 15, deterministic=True, attention_backend="doc_mask", **overrides)
        try:
            runs[name] = train(cfg, echo=None).losses
        except RuntimeError as exc:
            errors[name] = str(exc).splitlines()[0]
    if errors:
        assert set(errors) == {"eager", "graphed-layer"} and all("determinis" in e for e in errors.values()), errors
        report("doc_mask deterministic training: refused by torch", errors["eager"][:120])
        return
    assert all(loss == loss for loss in runs["eager"])
    report(
        "doc_mask deterministic 15 steps: losses equal graphed-layer vs eager", runs["graphed-layer"] == runs["eager"]
    )
    assert runs["graphed-layer"] == runs["eager"]
