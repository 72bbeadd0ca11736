"""Activation recomputation inside the graphs on the GPU (``capture_layers(..., recompute=True)``): an 8-layer bf16
stack against the same stack run eagerly under ``torch.utils.checkpoint`` (non-reentrant), and against graphs
without recomputation. Grads within bf16 tolerance; the recomputing step's peak memory (the last layer's backward
capture included) below the graphs' without it, and the step time beside eager-with-checkpointing's."""

import statistics

import torch
from torch.utils.checkpoint import checkpoint

from packgraph.graphs import capture_layers
from packgraph.models.gpt import Block, GPTConfig
from packgraph.params import PackedSeqParams

DEV = "cuda"
T, D, LAYERS = 4096, 1024, 8


def _stack():
    torch.manual_seed(0)
    cfg = GPTConfig(d_model=D, n_head=8, n_layer=LAYERS, vocab_size=256)
    return [Block(cfg).to(DEV, torch.bfloat16) for _ in range(LAYERS)]


def _params():
    return PackedSeqParams.from_seqlens([1500, 700, 1200, 600], capacity=8, total_tokens=T, max_seqlen=T, device=DEV)


def _step(fns, layers, p, seed):
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, D, device=DEV, dtype=torch.bfloat16, generator=g, requires_grad=True)
    h = x
    for fn in fns:
        h = fn(h, p)
    h.float().pow(2).mean().backward()
    return [x.grad] + [w.grad for layer in layers for w in layer.parameters()]


def _peak_and_ms(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn(0)  # the first step captures (graphs) or warms up (eager)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    times = []
    for i in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i + 1)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return peak, statistics.median(times)


def _graphed_steps(layers, p, recompute):
    """A step function that captures the stack at its first call (so its peak includes the captures)."""
    graphed = []

    def run(seed):
        if not graphed:
            sample = torch.randn(T, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            graphed.extend(capture_layers(layers, (sample, p), recompute=recompute))
        return _step(graphed, layers, p, seed)

    return run


def test_recomputed_graphs_match_checkpointed_eager_and_hold_less_memory(report):
    layers = _stack()
    p = _params()

    def eager_ckpt(seed):
        fns = [lambda h, q, layer=layer: checkpoint(layer, h, q, use_reentrant=False) for layer in layers]
        return _step(fns, layers, p, seed)

    want = eager_ckpt(1)
    want = [t.float().clone() for t in want]
    results = {}
    for recompute in (False, True):
        torch.cuda.empty_cache()
        run = _graphed_steps(layers, p, recompute)
        results[recompute] = _peak_and_ms(run)
        got = run(1)
        worst = max(
            ((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
            for a, b in zip(got, want, strict=True)
        )
        report(f"recompute={recompute}: max grad rel diff vs eager+checkpoint", worst)
        assert worst <= 3e-2
        del run, got
    eager_peak, eager_ms = _peak_and_ms(eager_ckpt)
    report(
        "recompute: peak MiB graphs / graphs+recompute / eager+checkpoint",
        f"{results[False][0] / 2**20:.0f} / {results[True][0] / 2**20:.0f} / {eager_peak / 2**20:.0f}",
    )
    report(
        "recompute: step ms graphs / graphs+recompute / eager+checkpoint",
        f"{results[False][1]:.2f} / {results[True][1]:.2f} / {eager_ms:.2f}",
    )
    assert results[True][0] < results[False][0]
