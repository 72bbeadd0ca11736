"""packgraph.ops.short_docs (short documents in local blocks, long ones in one FA2 call of few slots) against the
naive per-document loop in float64.

The FA2 call runs the fake kernel of tests/ops/test_attention.py, which leaves rows past a segment's max_seqlen
and rows in no segment as NaN (output and grads), as FA2 leaves them unwritten: the gap segments between long
documents are over-long there, so a row taken from the wrong path, or a grad not masked, fails the comparison.
"""

import dataclasses
import random

import pytest
import torch

from packgraph import PackedSeqParams
from packgraph.ops import attention as attention_mod
from packgraph.ops import short_docs
from tests.ops.test_attention import fake_apis, naive_attention, qkv

F64 = torch.float64
B = short_docs.BLOCK


def host_long_doc_offsets(cu, n_rows):
    """The boundaries next to a document longer than BLOCK, plus the first and last, ghosts after them."""
    n = len(cu) - 1
    lengths = [cu[i + 1] - cu[i] for i in range(n)]
    kept = [cu[j] for j in range(n + 1) if j in (0, n) or (j > 0 and lengths[j - 1] > B) or (j < n and lengths[j] > B)]
    size = short_docs.long_doc_slots(n_rows) + 1
    return kept + [cu[-1]] * (size - len(kept))


def random_lengths(rng, total):
    lengths = []
    while True:
        n = rng.choice([1, 2, 7, rng.randint(1, B), B, B + 1, rng.randint(B + 1, 3 * B)])
        if sum(lengths) + n > total:
            return lengths
        lengths.append(n)


def test_long_doc_offsets_match_a_host_loop():
    rng = random.Random(0)
    for trial in range(200):
        total = rng.choice([1, 129, 300, 700, 1000])
        lengths = random_lengths(rng, total - rng.randint(0, 20) if total > 20 else total)
        capacity = len(lengths) + rng.randint(0, 5)
        params = PackedSeqParams.from_seqlens(lengths, capacity=max(capacity, 1), total_tokens=total)
        got = short_docs.long_doc_offsets(params.cu_seqlens_q, total)
        assert got.dtype == torch.int32
        assert got.tolist() == host_long_doc_offsets(params.cu_seqlens_q.tolist(), total), (trial, lengths)


CASES = {
    "mixed": ([3, 200, 1, 1, 60, B, B + 1, 5, 250], 16, 900),
    "all_short": ([1] * 40 + [B, 7], 64, 300),
    "all_long": ([129, 300, 200], 4, 640),
    "long_first_and_last": ([400, 2, 3, 130], 8, 540),  # rows not a multiple of BLOCK
    "one_doc_no_tail": ([512], 2, 512),
    "empty": ([], 4, 256),
}


def _fwd_bwd(attend, base, weight):
    leaves = [x.clone().requires_grad_() for x in base]
    out = attend(*leaves)
    loss = (out * weight).sum()
    if loss.requires_grad:  # the loop's output has no graph when the packing holds no token
        loss.backward()
    return out, [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]


@pytest.mark.parametrize("version", ["2.11", "2.12"])
@pytest.mark.parametrize("case", list(CASES))
def test_short_and_long_equals_the_loop(monkeypatch, version, case):
    lengths, capacity, total = CASES[case]
    max_seqlen = max(lengths, default=1)
    params = PackedSeqParams.from_seqlens(
        lengths, capacity=capacity, total_tokens=total, max_seqlen=max_seqlen
    ).replace(short_docs_min_slots=1)
    calls = []
    api = attention_mod._VarlenAPI.from_function(fake_apis(calls)[version])
    base = qkv(total, 4, 2, 8, seed=3)
    weight = torch.randn(total, 4, 8, generator=torch.Generator().manual_seed(4), dtype=F64)
    for scale in (None, 0.3):
        out, grads = _fwd_bwd(
            lambda q, k, v, s=scale: attention_mod._flash_attention(
                q, k, v, params, causal=True, softmax_scale=s, api=api
            ),
            base,
            weight,
        )
        want, want_grads = _fwd_bwd(
            lambda q, k, v, s=scale: naive_attention(q, k, v, params, True, scale=s), base, weight
        )
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)  # a NaN anywhere fails here
        for name, a, b in zip("qkv", grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
        with torch.no_grad():
            again = attention_mod._flash_attention(*base, params, causal=True, softmax_scale=scale, api=api)
        torch.testing.assert_close(again, want, rtol=1e-10, atol=1e-12)
    # Every FA2 call ran on the long documents' offsets, not on the capacity's.
    assert {c["slots"] for c in calls} == {short_docs.long_doc_slots(total)}, calls


def test_frozen_inputs_get_no_grad(monkeypatch):
    """Only v requires grad (q and k frozen): v's grad equals the loop's, q and k get none."""
    lengths, capacity, total = CASES["mixed"]
    params = PackedSeqParams.from_seqlens(lengths, capacity=capacity, total_tokens=total, max_seqlen=250).replace(
        short_docs_min_slots=1
    )
    api = attention_mod._VarlenAPI.from_function(fake_apis([])["2.12"])
    q, k, v = qkv(total, 4, 2, 8, seed=5)
    v = v.clone().requires_grad_()
    attention_mod._flash_attention(q, k, v, params, causal=True, softmax_scale=None, api=api).sum().backward()
    v_ref = v.detach().clone().requires_grad_()
    naive_attention(q, k, v_ref, params, True).sum().backward()
    torch.testing.assert_close(v.grad, v_ref.grad, rtol=1e-10, atol=1e-12)
    assert q.grad is None and k.grad is None


def test_used_only_where_it_applies(monkeypatch):
    """Below short_docs_min_slots, non-causal, with padded twins, or with kv offsets of their own, one FA2 call
    runs on the params' own offsets."""
    calls = []
    api = attention_mod._VarlenAPI.from_function(fake_apis(calls)["2.12"])
    lengths, capacity, total = CASES["mixed"]
    plain = PackedSeqParams.from_seqlens(lengths, capacity=capacity, total_tokens=total, max_seqlen=250)
    padded = PackedSeqParams.from_seqlens(
        lengths, capacity=capacity, total_tokens=total + 32, max_seqlen=256, pad_to_multiple=2
    )
    own_kv = plain.replace(cu_seqlens_kv=plain.cu_seqlens_kv.clone())
    q, k, v = qkv(total + 32, 4, 2, 8, seed=6)
    below = plain.replace(short_docs_min_slots=capacity + 1)
    attention_mod._flash_attention(q[:total], k[:total], v[:total], below, causal=True, softmax_scale=None, api=api)
    assert calls[-1]["slots"] == capacity
    plain, padded, own_kv = (p.replace(short_docs_min_slots=1) for p in (plain, padded, own_kv))
    for params, causal, rows in ((plain, False, total), (padded, True, total + 32), (own_kv, True, total)):
        attention_mod._flash_attention(q[:rows], k[:rows], v[:rows], params, causal=causal, softmax_scale=None, api=api)
        assert calls[-1]["slots"] == attention_mod.flash_offsets(params)[0].numel() - 1
    attention_mod._flash_attention(q[:total], k[:total], v[:total], plain, causal=True, softmax_scale=None, api=api)
    assert calls[-1]["slots"] == short_docs.long_doc_slots(total)


def test_the_result_does_not_depend_on_the_bucket(monkeypatch):
    """A batch's attention is bit for bit the same at its own params and at its bucket's, as a graphed call must
    equal eager: off, by default (short_docs from 129 slots) and from 513 (each one more than a rung). At 512, a
    batch of fewer documents could land in a 512-slot bucket on the other kernel, so the policy adds a rung of
    511."""
    from packgraph.buckets import default_buckets

    total = 1024
    api = attention_mod._VarlenAPI.from_function(fake_apis([])["2.12"])
    q, k, v = qkv(total, 4, 2, 8, seed=8)

    def attend(p):
        return attention_mod._flash_attention(q, k, v, p, causal=True, softmax_scale=None, api=api)

    few = PackedSeqParams.from_seqlens([1, 3] * 90 + [300, 200] + [2] * 18, total_tokens=total)  # 200 documents
    many = PackedSeqParams.from_seqlens([1] * 599 + [300], total_tokens=total)  # 600
    ghosts = PackedSeqParams.from_seqlens([1, 3] * 90 + [300, 200] + [2] * 18, capacity=1000, total_tokens=total)
    small = PackedSeqParams.from_seqlens([3] * 100 + [300], total_tokens=total)  # 101: FA2 at its own and at 128
    # ghosts: from 513, kept past 512 so that the kernel stays short_docs; at 129 its 200 used slots keep it
    for m, slots in ((None, (512, 1024, 512, 128)), (129, (512, 1024, 512, 128)), (513, (512, 1024, 1024, 128))):
        policy = dataclasses.replace(default_buckets(total), short_docs_min_slots=m)  # capacity rungs ..., 128, 512
        for params, want in zip((few, many, ghosts, small), slots, strict=True):
            params = params.replace(short_docs_min_slots=m)  # eager runs the policy's switch too
            bucketed = policy.apply(params)
            assert bucketed.capacity == want and bucketed.short_docs_min_slots == m, (m, params.capacity)
            assert torch.equal(attend(params), attend(bucketed)), (m, params.capacity)

    # At 512 the policy adds a rung of 511: 200 documents stay below the switch, on FlashAttention, both ways.
    policy = dataclasses.replace(default_buckets(total), short_docs_min_slots=512)
    assert 511 in policy.capacity_ladder
    params = few.replace(short_docs_min_slots=512)
    bucketed = policy.apply(params)
    assert bucketed.capacity == 511 and torch.equal(attend(params), attend(bucketed))


def test_the_two_kernels_round_differently(monkeypatch):
    """Why the choice must not move with the bucket: short_docs and one FA2 call give the same attention but not
    the same bits (here the fake FA2 kernel and the local path's math SDPA, in float64)."""
    params = PackedSeqParams.from_seqlens([1, 3] * 90 + [300, 200] + [2] * 18, total_tokens=1024)
    api = attention_mod._VarlenAPI.from_function(fake_apis([])["2.12"])
    q, k, v = qkv(1024, 4, 2, 8, seed=8)
    off, on = params.replace(short_docs_min_slots=None), params.replace(short_docs_min_slots=1)
    one_call = attention_mod._flash_attention(q, k, v, off, causal=True, softmax_scale=None, api=api)
    short = attention_mod._flash_attention(q, k, v, on, causal=True, softmax_scale=None, api=api)
    torch.testing.assert_close(short, one_call, rtol=1e-12, atol=1e-12)
    assert not torch.equal(short, one_call)


@pytest.mark.parametrize("hkv", [4, 2])
def test_local_path_grads_are_exact_zeros_off_the_short_documents(hkv):
    """The local path needs no grad mask: with its output grad zero outside the short documents' rows (the
    caller's select), its q/k/v grads on the long documents' rows and on the tail are exact zeros, whatever
    finite values those rows hold (here 1e3 times larger)."""
    lengths, capacity, total = CASES["mixed"]
    params = PackedSeqParams.from_seqlens(lengths, capacity=capacity, total_tokens=total, max_seqlen=250)
    rows = attention_mod.row_layout(params, "q", total)
    short = rows.live & (rows.length <= B)
    q, k, v = (torch.where(short[:, None, None], x, 1e3 * x).requires_grad_() for x in qkv(total, 4, hkv, 8, seed=9))
    mask = short_docs.local_mask(rows.slot, q.dtype)
    out = short_docs._LocalRecomputed.apply(q, k, v, mask, 0.3)
    assert torch.equal(out, short_docs.local_block_attention(q, k, v, mask, scale=0.3))
    grad = torch.where(short[:, None, None], torch.randn(total, 4, 8, dtype=F64), 0)
    got = torch.autograd.grad(out, (q, k, v), grad)
    for name, g in zip("qkv", got, strict=True):
        assert torch.equal(g[~short], torch.zeros_like(g[~short])), name
        assert g[short].abs().sum() > 0, name
