"""Memory invariants of one capture group, measured as ratios in one process on the GPU.

A small GPT (d=512, 4 layers, T=2048, bf16 autocast, AdamW) trains on streams of packed batches through
``model.graphed(scope="layer", buckets=default_buckets(T))``. Every bucket shares one pool, one activation set and
one set of forward buffers per layer, the stack two hidden-state grad buffers, the grads of idle buckets go back to
the pool, and warm-ups allocate from the pool, so

* a stream that visits four buckets reserves about what one that stays in one does, and its allocated peak is
  eager's on the same batches (its reserved peak is within a bound that the allocator's segment rounding sets);
* capturing a new bucket mid-run does not raise the reserved peak much above the steady state's.

The exact targets (allocated <= 1.00x, reserved <= 1.10x eager) are checked by ``packgraph bench``; these tests keep
the invariants with a margin for the allocator's block rounding.
"""

import gc

import pytest
import torch

from packgraph.buckets import default_buckets
from packgraph.graphs import memory
from packgraph.graphs.memory import release_spare_pools
from packgraph.graphs.recorder import loop_stream
from packgraph.models.gpt import GPT, GPTConfig
from packgraph.packing import PackedBatch

pytestmark = pytest.mark.cuda

T = 2048
DEV = "cuda"


def _batch(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in lengths]
    return PackedBatch.from_documents(docs, bin_size=T, capacity=len(lengths), max_seqlen=max(lengths)).to(DEV)


# One batch per bucket: (max_seqlen rung, capacity rung) of default_buckets(2048) = (1024, 8), (256, 32),
# (2048, 8), (256, 128).
_FOUR = [[700, 300, 20], [200] * 9, [2000, 40], [10] * 100]


def _run(stream, graphed: bool, steps_per_batch: int = 2):
    # the whole run on one non-default stream, as packgraph's trainers run: graphs and eager code share cuBLAS
    # workspaces (packgraph.graphs.recorder)
    with loop_stream(DEV):
        return _run_on_loop_stream(stream, graphed, steps_per_batch)


def _run_on_loop_stream(stream, graphed: bool, steps_per_batch: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=512, n_layer=4, n_head=8)).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    runner = model.graphed(scope="layer", buckets=default_buckets(T)) if graphed else model
    gc.collect()
    torch.cuda.synchronize()
    # cuBLAS keeps a workspace per (thread, stream) it ran on until cleared, and torch recycles its pooled streams:
    # without this a run's peak would depend on which workspaces earlier tests left.
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    peaks = []
    for batch in stream:
        for _ in range(steps_per_batch):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = runner(batch)[1]
            loss.backward()
            opt.step()
        torch.cuda.synchronize()
        peaks.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
    captures = runner.captures if graphed else 0
    del runner, model, opt, loss
    gc.collect()
    torch.cuda.synchronize()
    release_spare_pools()  # the next run's reserved peak would count them
    torch.cuda.empty_cache()
    return peaks, captures


def _workspaces_held(graphed: bool, scope: str = "layer") -> int:
    """Bytes of cuBLAS workspaces a model holds after two training steps on one loop stream: what clearing them
    frees."""
    with loop_stream(DEV):
        return _workspaces_held_on_loop_stream(graphed, scope)


def _workspaces_held_on_loop_stream(graphed: bool, scope: str) -> int:
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=512, n_layer=2, n_head=8)).to(DEV)
    runner = model.graphed(scope=scope, buckets=default_buckets(T)) if graphed else model
    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    batch = _batch(_FOUR[0], 0)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = runner(batch)[1]
        loss.backward()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    # The graphs keep pointers to their workspaces: clear them only once the graphs will not replay again.
    torch._C._cuda_clearCublasWorkspaces()
    held -= torch.cuda.memory_allocated()
    del runner, model, loss
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return held


@pytest.mark.parametrize("scope", ["layer", "attn"])
def test_graphs_hold_as_many_cublas_workspaces_as_eager(scope, report):
    """cuBLAS keeps a workspace per (thread, stream): graphs use their capture stream's, from the forward's thread
    and autograd's. On a loop stream the graphs are captured on the stream the eager head (and, for scope "attn",
    the eager MLPs) runs on (packgraph.graphs.recorder), so a graphed model holds eager's two workspaces, not four."""
    eager, graphed = _workspaces_held(False), _workspaces_held(True, scope)
    report(f"memory: cuBLAS workspaces held, eager / graphed scope {scope} (MiB)", f"{eager / 2**20:.0f} / "
           f"{graphed / 2**20:.0f}")  # fmt: skip
    assert eager > 0
    assert graphed == eager


def test_four_buckets_peak_no_higher_than_one(report):
    one = [_batch(_FOUR[0], seed) for seed in range(4)]
    four = [_batch(lengths, seed) for seed, lengths in enumerate(_FOUR)]
    settled = memory.settled_bytes
    (p_one, c_one), (p_four, c_four) = _run(one, True), _run(four, True)
    settled = memory.settled_bytes - settled
    (e_four, _) = _run(four, False)
    report("memory: bytes copied off graph memory for holders, both graphed streams (MiB)", settled / 2**20)
    report("memory: peak allocated, graphed one bucket / four buckets / eager four buckets (MiB)",
           f"{p_one[-1][0] / 2**20:.1f} / {p_four[-1][0] / 2**20:.1f} / {e_four[-1][0] / 2**20:.1f}")  # fmt: skip
    alloc = p_four[-1][0] / p_one[-1][0]
    reserved = p_four[-1][1] / p_one[-1][1]
    report("memory: buckets captured (one-bucket / four-bucket stream)", f"{c_one} / {c_four}")
    report("memory: peak allocated, four buckets / one bucket", alloc)
    report("memory: peak reserved, four buckets / one bucket", reserved)
    report("memory: graphed / eager peak allocated (four buckets)", p_four[-1][0] / e_four[-1][0])
    report("memory: graphed / eager peak reserved (four buckets)", p_four[-1][1] / e_four[-1][1])
    assert c_one == 1 and c_four == 4
    # Allocated memory counts a graph's activations only while it is captured (replays use pool memory the
    # allocator sees as free), and three of the four captures run after AdamW made its state: the fair comparison
    # of allocated memory is with eager on the same batches. A capture step holds what eager's step holds, plus
    # the two chained grad buffers and FA2's per-slot backward buffers for the bucket's ghost slots (its capacity
    # over the batch's documents). The graphs are captured on the loop stream the embedding, head and loss run on
    # (packgraph.graphs.recorder), so they hold eager's two cuBLAS workspaces, not two more.
    assert p_four[-1][0] <= 1.01 * e_four[-1][0]
    # Reserved memory is the pool itself beside the loop stream's cache (the eager parts' tensors): caches that each
    # round to segments of their own (20 MiB for tensors of 1-10 MiB). At this 4-layer model's ~550 MiB that costs
    # up to 25%; the 1.10x target is the benchmark's, at its models' sizes.
    assert p_four[-1][1] <= 1.25 * e_four[-1][1]
    assert reserved <= 1.08


def test_new_buckets_captured_before_the_embedding_lower_the_capture_peak(report, monkeypatch):
    """``GraphedGPT`` captures a new bucket's stack before it embeds the tokens (``capture_ahead``), so the capture
    step does not hold the embedding output (T x d_model fp32) beside the first block's input buffer. Against the
    same stream captured at the first block's call, in one process, the peak allocated falls."""
    from packgraph.graphs.capture import GraphedCallable

    four = [_batch(lengths, seed) for seed, lengths in enumerate(_FOUR)]
    (ahead, c_ahead) = _run(four, True)
    monkeypatch.setattr(GraphedCallable, "capture_ahead", lambda self, *a, **k: False)
    (at_call, c_at_call) = _run(four, True)
    saved = at_call[-1][0] - ahead[-1][0]
    report("memory: peak allocated saved by capturing before the embedding (MiB)", saved / 2**20)
    report("memory: embedding output T x d_model fp32 (MiB)", T * 512 * 4 / 2**20)
    assert c_ahead == c_at_call == 4
    assert saved > 0


def test_capturing_a_new_bucket_mid_run_keeps_the_reserved_peak(report):
    stream = [_batch(_FOUR[0], seed) for seed in range(3)] + [_batch(lengths, 9) for lengths in _FOUR[1:]]
    peaks, captures = _run(stream, True)
    steady = peaks[2][1]  # after three batches of the first bucket (its capture included)
    worst = max(reserved for _, reserved in peaks[3:])
    report("memory: reserved peak after 3 new-bucket captures / steady", worst / steady)
    assert captures == 4
    assert worst <= 1.08 * steady


def test_chained_grad_buffers_are_allocated_only_while_a_backward_runs(report):
    """Eager holds the hidden-state grads only during its backward; the stack's two chained grad buffers are one
    block of a memory pool of their own, allocated at a step's first backward replay and freed at the next forward
    (packgraph.graphs.memory). ``torch.cuda.empty_cache()`` between steps keeps the pool's segment, so the block
    comes back at the address the graphs write (a lend checks it), and the grads stay eager's."""
    from tests.cuda.test_gpt_cuda import GRAD_RTOL, LOSS_ATOL, loss_and_grads

    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=512, n_layer=4, n_head=8)).to(DEV)
    graphed = model.graphed(scope="layer", buckets=default_buckets(T))
    batches = [_batch(lengths, seed) for seed, lengths in enumerate(_FOUR)] + [_batch(_FOUR[0], 7)]
    lent_bytes = []
    for i, batch in enumerate(batches):
        g_loss, g_grads = loss_and_grads(model, graphed, batch)
        blocks = list(graphed.callables[0].group.memory.chain_buffers._blocks.values())
        assert len(blocks) == 1 and blocks[0].memory is not None  # lent by the backward, until the next forward
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            graphed(batch)  # a forward: the block goes back to its pool
        assert blocks[0].memory is None
        buffers = graphed.callables[0].group.memory.chain_buffers
        buffers.lend()
        before = torch.cuda.memory_allocated()
        buffers.give_back()
        lent_bytes.append(before - torch.cuda.memory_allocated())
        torch.cuda.empty_cache()
        e_loss, e_grads = loss_and_grads(model, model, batch)
        assert float((g_loss - e_loss).abs()) <= LOSS_ATOL, i
        for name, e in e_grads.items():
            assert float((g_grads[name] - e).abs().max()) <= GRAD_RTOL * (float(e.abs().max()) + 1e-6), (i, name)
    report("memory: chained grad block freed at each forward (MiB)", f"{blocks[0].nbytes / 2**20:.1f}")
    assert all(n == blocks[0].nbytes for n in lent_bytes), lent_bytes
    # Two fp32 [T, 512] buffers (8 MiB) sit in a 10 MiB segment; a lend allocates the 8 MiB, not the segment.
    assert blocks[0].nbytes == 2 * T * 512 * 4 < blocks[0].segment_bytes
