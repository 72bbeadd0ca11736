"""apply_rope_thd / rope_positions against a per-document loop with positions written by hand (float64)."""

import pytest
import torch

from packgraph import PackedSeqParams
from packgraph.ops import apply_rope_thd, rope_positions

F64 = torch.float64


def rotate_token(x, position, base):
    """Rotate-half RoPE of one token x [H, D]: pairs (i, i + D/2) rotate by position * base**(-2i/D)."""
    d = x.shape[-1]
    half = d // 2
    out = torch.empty_like(x)
    for i in range(half):
        theta = torch.tensor(position * base ** (-2.0 * i / d), dtype=F64)
        c, s = torch.cos(theta), torch.sin(theta)
        a, b = x[:, i], x[:, i + half]
        out[:, i] = a * c - b * s
        out[:, i + half] = b * c + a * s
    return out


def hand_positions(lengths, capacity, total_tokens, pad):
    """Positions restart at each (padded) document start; padding and the tail keep counting from their start."""
    starts, offset = [], 0
    for n in lengths:
        starts.append(offset)
        offset += -(-n // pad) * pad
    starts += [offset] * (capacity - len(lengths) + 1)  # ghost slots and the tail begin at the last offset
    positions = []
    for row in range(total_tokens):
        start = max(s for s in starts if s <= row)
        positions.append(row - start)
    return positions


CASES = {
    "plain": ([5, 3, 7], 3, 15, 1),
    "ghosts_and_tail": ([4, 0, 1, 2], 7, 12, 1),
    "padded_4": ([5, 1, 0, 3], 6, 24, 4),
    "padded_8_tail": ([9, 2], 3, 30, 8),
}


@pytest.mark.parametrize("case", list(CASES))
def test_positions_by_hand(case):
    lengths, capacity, total, pad = CASES[case]
    params = PackedSeqParams.from_seqlens(lengths, capacity=capacity, total_tokens=total, pad_to_multiple=pad)
    positions = rope_positions(params, total)
    assert positions.dtype == torch.int64 and positions.shape == (total,)
    assert positions.tolist() == hand_positions(lengths, capacity, total, pad)


@pytest.mark.parametrize("base", [10000.0, 500.0])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_per_document_loop(case, base):
    lengths, capacity, total, pad = CASES[case]
    params = PackedSeqParams.from_seqlens(lengths, capacity=capacity, total_tokens=total, pad_to_multiple=pad)
    x = torch.randn(total, 3, 8, generator=torch.Generator().manual_seed(0), dtype=F64)
    out = apply_rope_thd(x, params, base=base)
    # Real tokens, document by document, positions 0..len-1 within each document.
    want = x.clone()
    start = 0
    for n in lengths:
        for p in range(n):
            want[start + p] = rotate_token(x[start + p], p, base)
        start += -(-n // pad) * pad
    live = torch.zeros(total, dtype=torch.bool)
    start = 0
    for n in lengths:
        live[start : start + n] = True
        start += -(-n // pad) * pad
    torch.testing.assert_close(out[live], want[live], rtol=1e-12, atol=1e-12)
    assert out.shape == x.shape and out.dtype == x.dtype


def test_position_ids_override():
    params = PackedSeqParams.from_seqlens([4, 6], capacity=3, total_tokens=12)
    x = torch.randn(12, 2, 6, generator=torch.Generator().manual_seed(1), dtype=F64)
    position_ids = torch.tensor([7, 8, 9, 10, 100, 101, 102, 103, 104, 105, 0, 3])  # e.g. a context-parallel shard
    want = torch.stack([rotate_token(x[r], int(position_ids[r]), 10000.0) for r in range(12)])
    torch.testing.assert_close(apply_rope_thd(x, params, position_ids=position_ids), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(apply_rope_thd(x, params, position_ids=position_ids[None]), want, rtol=1e-12, atol=1e-12)


def test_low_precision_and_gradients():
    params = PackedSeqParams.from_seqlens([5, 3, 2], capacity=4, total_tokens=12, pad_to_multiple=2)
    x = torch.randn(12, 2, 16, generator=torch.Generator().manual_seed(2), dtype=F64)
    want = apply_rope_thd(x, params)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        out = apply_rope_thd(x.to(dtype), params)
        assert out.dtype == dtype
        torch.testing.assert_close(out.to(F64), want, rtol=tol, atol=tol)
    # RoPE is a rotation: the gradient of <rope(x), w> is rope^T(w), checked against finite differences.
    leaf = x[:, :, :4].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: apply_rope_thd(t, params, base=50.0), (leaf,))


def test_rejects_bad_inputs():
    params = PackedSeqParams.from_seqlens([3, 3])
    with pytest.raises(ValueError, match="even"):
        apply_rope_thd(torch.randn(6, 2, 5), params)
    with pytest.raises(ValueError, match="tokens, heads, head_dim"):
        apply_rope_thd(torch.randn(6, 8), params)
    with pytest.raises(ValueError, match="position_ids"):
        apply_rope_thd(torch.randn(6, 2, 4), params, position_ids=torch.arange(5))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(x=torch.ones(6, 2, 4, dtype=torch.int64)), "x must be floating point"),
        (dict(position_ids=torch.arange(6).reshape(2, 3)), r"position_ids must be \[6\] or \[1, 6\]"),
        (dict(position_ids=torch.arange(6).reshape(3, 2)), r"position_ids must be \[6\] or \[1, 6\]"),
        (dict(position_ids=torch.arange(6.0)), "position_ids must be an integer tensor"),
        (dict(base=0.0), "base must be a finite number > 0"),
        (dict(base=-10000.0), "base must be a finite number > 0"),
        (dict(base=float("inf")), "base must be a finite number > 0"),
        (dict(base=float("nan")), "base must be a finite number > 0"),
    ],
)
def test_rejects_inputs_it_would_round_reshape_or_turn_to_nan(kwargs, match):
    # Issue #31 item 7: an int x came back rounded, [2, 3] position_ids were flattened, base=0 gave NaN.
    params = PackedSeqParams.from_seqlens([3, 3])
    x = kwargs.pop("x", torch.randn(6, 2, 4))
    with pytest.raises(ValueError, match=match) as e:
        apply_rope_thd(x, params, **kwargs)
    assert str(e.value).startswith("apply_rope_thd: ") and "\n" not in str(e.value)


def test_compiles_without_a_graph_break_with_its_cache_empty():
    """Under torch.compile the inverse frequencies are a constant of the graph, evaluated when Dynamo traces:
    traced, the cache of eager calls (empty at a compiled model's first call) would break the graph (Dynamo cannot
    trace its inference-mode query), and computed in the graph, Inductor would recompute ``pow`` for every element
    it rotates. One graph, no ``pow`` in it, no recompile once the cache is filled, values as eager's."""
    import packgraph.ops.rope as rope_mod

    params = PackedSeqParams.from_seqlens([30, 20, 1], capacity=4, total_tokens=64)
    x = torch.randn(64, 2, 16, generator=torch.Generator().manual_seed(0))

    def step(x: torch.Tensor, params: PackedSeqParams) -> torch.Tensor:
        return apply_rope_thd(x, params, base=500.0) * 2

    rope_mod._inv_freq_cache.clear()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(x, params)
    assert explained.graph_break_count == 0, [b.reason.splitlines()[0] for b in explained.break_reasons]
    assert explained.graph_count == 1
    ops = {str(node.target) for graph in explained.graphs for node in graph.graph.nodes}
    assert not any("pow" in op for op in ops), sorted(ops)
    torch._dynamo.reset()
    rope_mod._inv_freq_cache.clear()
    compiled = torch.compile(step, backend="eager")
    first = compiled(x, params)
    assert rope_mod._inv_freq_cache  # filled by the trace's evaluation
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch.testing.assert_close(compiled(x, params), step(x, params), rtol=0, atol=0)
    torch.testing.assert_close(first, step(x, params), rtol=0, atol=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no recompile
