"""Graphed training on a GPU that another process keeps busy: the losses stay eager's, bit for bit.

A busy GPU runs each kernel late, so the host queues steps far ahead of it, and any work that reads memory before
another stream has written it reads it early. That is how a design that ran the eager code around graphed layers
on the graphs' capture stream failed: with the GPU shared, graphed losses turned NaN within a few steps, while
alone they were eager's bit for bit. Graphs now replay on the caller's stream, and packgraph's loops run on one
stream (packgraph.graphs.recorder). Both paths run here with a second process saturating the GPU with matmuls: the
demo (``packgraph train``'s loop, on a loop stream) and a plain loop on the default stream with unchained graphs
(recorded on a side stream, replayed on the caller's); a chained stack refuses the default stream. The chained
stacks' grad buffers, allocated on a stream of their own, are lent without writing on it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from packgraph.models.gpt import GPT, GPTConfig
from packgraph.packing import PackedBatch
from packgraph.train import deterministic_kernels

SRC = str(Path(__file__).resolve().parents[2] / "src")
_HOG = """
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
print("busy", flush=True)
end = time.time() + 300
while time.time() < end:
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
"""


@contextlib.contextmanager
def _busy_gpu():
    hog = subprocess.Popen([sys.executable, "-c", _HOG], stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout.readline().strip() == "busy"
        yield
    finally:
        hog.kill()
        hog.wait()


def test_demo_losses_stay_bitwise_equal_on_a_shared_gpu(tmp_path, report):
    out = tmp_path / "demo"
    argv = ["demo", "--device", "cuda", "--preset", "tiny", "--T", "1024", "--max-docs", "40", "--steps", "30"]
    argv += ["--scopes", "layer,model", "--out-dir", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    with _busy_gpu():
        done = subprocess.run(
            [sys.executable, "-m", "packgraph.cli", *argv], capture_output=True, text=True, env=env, timeout=300
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    methods = json.loads((out / "demo.json").read_text())["methods"]
    eager = methods["eager"]["losses"]
    for name in ("graphed-layer", "graphed-model"):
        equal = sum(a == b for a, b in zip(methods[name]["losses"], eager, strict=True))
        report(f"shared GPU: demo {name} bitwise-equal steps", f"{equal}/{len(eager)}")
        assert methods[name]["losses"] == eager, name


def _batches(n: int, T: int = 1024) -> list[PackedBatch]:
    gen = torch.Generator().manual_seed(0)
    shapes = [[300, 200, 100], [1000], [64] * 12, [500, 400, 20], [128] * 6, [900, 90]]
    out = []
    for lengths in (shapes * n)[:n]:
        docs = [torch.randint(0, 256, (k,), generator=gen) for k in lengths]
        out.append(PackedBatch.from_documents(docs, bin_size=T, capacity=16, max_seqlen=T, pad_id=0).to("cuda"))
    return out


def _losses(graphed: bool, scope: str, batches: list[PackedBatch]) -> list[float]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, d_model=256, n_layer=4, n_head=4)).cuda()
    runner = model.graphed(scope=scope) if graphed else model  # one static layout: eager runs the same kernels
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for batch in batches:  # the default stream, no sync until the end: the host runs ahead of the busy GPU
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = runner(batch)[1]
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses).tolist()


@pytest.mark.default_stream
def test_a_loop_on_the_default_stream_stays_bitwise_equal_on_a_shared_gpu(report):
    """Unchained graphs (scope ``attn``) replay on the default stream, recorded on a side stream."""
    batches = _batches(24)
    with deterministic_kernels(True), _busy_gpu():
        eager = _losses(False, "attn", batches)
        graphed = _losses(True, "attn", batches)
    equal = sum(a == b for a, b in zip(graphed, eager, strict=True))
    report("shared GPU: default-stream loop, scope attn, bitwise-equal steps", f"{equal}/{len(eager)}")
    assert graphed == eager


@pytest.mark.default_stream
def test_a_chained_stack_refuses_a_stream_it_was_not_recorded_on():
    """Whole layers (a chained stack) from the default stream gave 14 of 24 steps bitwise with the GPU busy (24 of
    24 alone): a replay off the stack's recording stream raises, naming loop_stream."""
    batch = _batches(1)[0]
    model = GPT(GPTConfig(vocab_size=256, d_model=256, n_layer=2, n_head=4)).cuda()
    graphed = model.graphed(scope="layer")
    with pytest.raises(RuntimeError, match="loop_stream"):
        graphed(batch)


def test_a_lent_grad_slot_block_is_written_on_the_callers_stream_only(report):
    """The chained stacks' hidden-state grad buffers are allocated on a stream of their own (packgraph.graphs.memory)
    and used on the caller's. Under deterministic algorithms torch.empty fills new memory with a kernel on the
    stream it allocates on: that fill ran in no order with the backward replays, and on a busy GPU it landed in the
    middle of one, turning the grads NaN (test_gpt_cuda's deterministic runs under gpu-check --jobs 4). Here the
    buffers' stream is held back by a sleep when the block is lent: a value the caller writes right after must
    survive."""
    from packgraph.graphs import memory

    like = torch.empty(2048, 256, device="cuda")
    block = memory._Block(like)
    try:
        with deterministic_kernels(True):
            assert torch.utils.deterministic.fill_uninitialized_memory  # torch.empty fills under these
            block.memory = None  # given back before a forward
            with torch.cuda.stream(block.stream):
                torch.cuda._sleep(200_000_000)  # ~0.1 s: anything queued there now runs late
            block.lend()
            for static in block.statics:
                static.fill_(1.0)
            torch.cuda.synchronize()
        kept = all(bool((s == 1.0).all()) for s in block.statics)
        report("chained grad buffers: a lend on a held-back stream kept the caller's writes", kept)
        assert kept, "the lend wrote the buffers on their own stream after the caller's writes"
    finally:
        block.close()
