import pytest
import torch

from packgraph.ops import attention, varlen_attention
from packgraph.params import PackedSeqParams
from tests.bench.records import load_bench_script

attention_split = load_bench_script("attention_split")


class _NaNRows(torch.autograd.Function):
    """``x`` with NaN in rows ``rows`` (forward, ``where_out``) or in its gradient's rows (backward)."""

    @staticmethod
    def forward(ctx, x, rows, where_out):
        ctx.save_for_backward(rows)
        ctx.where_out = where_out
        return torch.where(rows[:, None, None], float("nan"), x) if where_out else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return (grad if ctx.where_out else torch.where(rows[:, None, None], float("nan"), grad)), None, None


def _like_flash(q, k, v, params):
    """The exact reference, but as FlashAttention-2 leaves an over-long segment: rows past max_seqlen are never
    written, so they read NaN here (output, and the grads of q, k and v). The CPU then forgives nothing CUDA
    would not."""
    past_q, past_k = (
        (lay.pos >= m) & lay.live
        for lay, m in (
            (attention.row_layout(params, "q", q.shape[0]), params.max_seqlen_q),
            (attention.row_layout(params, "kv", k.shape[0]), params.max_seqlen_kv),
        )
    )
    q, k, v = (_NaNRows.apply(t, rows, False) for t, rows in ((q, past_q), (k, past_k), (v, past_k)))
    return _NaNRows.apply(varlen_attention(q, k, v, params), past_q, True)


@pytest.mark.parametrize(
    "lengths, capacity, rest",
    [([5, 40, 3, 7], 8, 8), ([40, 1, 1], 4, 4), ([2, 3, 50], 3, 16), ([64], 2, 1)],
    ids=["middle", "first", "last", "alone"],
)
def test_split_equals_one_call_outputs_and_grads(monkeypatch, lengths, capacity, rest):
    """The longest document alone plus the rest at ``rest`` (where the longest is an over-long segment, NaN past
    ``rest`` as FlashAttention would leave it) equals one call, the tail's rows included."""
    T = sum(lengths) + 6  # a dead tail
    params = PackedSeqParams.from_seqlens(lengths, capacity=capacity, total_tokens=T, max_seqlen=64)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, 4, 8, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3))
    grad_out = torch.randn(T, 4, 8, dtype=torch.float64, generator=g)

    want = varlen_attention(q, k, v, params)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    monkeypatch.setattr(attention_split, "varlen_attention", _like_flash)
    got = attention_split.split_attention(q, k, v, params, rest)
    got_grads = torch.autograd.grad(got, (q, k, v), grad_out)

    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
