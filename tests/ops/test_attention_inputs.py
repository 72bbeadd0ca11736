"""varlen_attention's input checks: one-line ValueErrors naming the argument, before any arithmetic on it."""

import pytest
import torch

from packgraph import PackedSeqParams
from packgraph.ops import varlen_attention, varlen_attention_reference


@pytest.mark.parametrize("op", [varlen_attention, varlen_attention_reference])
@pytest.mark.parametrize(
    "dtype, head_dim, match",
    [
        (torch.float32, 0, r"head_dim \(q.shape\[2\]\) must be >= 1, got 0"),  # was 1 / sqrt(0): ZeroDivisionError
        (torch.int64, 4, "q/k/v must be floating point, got torch.int64"),  # was a TypeError from torch.finfo
        (torch.bool, 4, "q/k/v must be floating point, got torch.bool"),
    ],
)
def test_rejects_empty_heads_and_non_float_inputs(op, dtype, head_dim, match):
    params = PackedSeqParams.from_seqlens([3, 2])
    q = torch.zeros(5, 2, head_dim, dtype=dtype)
    with pytest.raises(ValueError, match=match) as e:
        op(q, q, q, params)
    assert str(e.value).startswith("varlen_attention: ") and "\n" not in str(e.value)
