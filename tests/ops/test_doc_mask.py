"""Document-mask attention (FlexAttention with a block mask built from the offsets) against the exact reference,
forward only: torch's FlexAttention has no backward on the CPU. Grads, speed and CUDA-graph capture are the GPU's
to check (issue #36)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from packgraph.ops.attention import varlen_attention_reference
from packgraph.ops.doc_mask import doc_mask_attention, document_block_mask
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


def test_refuses_cross_attention_by_name():
    q, k, v, params = _case("plain", 4, 2)
    with pytest.raises(ValueError, match="use varlen_attention"):
        doc_mask_attention(q[:40], k, v, params)
