"""Bucket policy: rung choice against a brute-force search, apply() against params rebuilt from scratch."""

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packgraph.buckets import Bucket, BucketPolicy, default_buckets
from packgraph.packing import PackedBatch
from packgraph.params import PackedSeqParams

SETTINGS = settings(max_examples=80, deadline=None)

ladders = st.lists(st.integers(1, 600), min_size=1, max_size=6, unique=True).map(sorted).map(tuple)


@SETTINGS
@given(seqlens=ladders, caps=ladders, max_seqlen=st.integers(0, 700), num_seqs=st.integers(0, 700))
def test_bucket_for_is_smallest_fitting_rung(seqlens, caps, max_seqlen, num_seqs):
    policy = BucketPolicy(seqlens, caps)
    caps = policy.capacity_ladder  # with short_docs' boundary rung, where the switch adds one
    fitting = [Bucket(s, c) for s in seqlens for c in caps if s >= max_seqlen and c >= num_seqs]
    if not fitting:
        with pytest.raises(ValueError, match="add a"):
            policy.bucket_for(max_seqlen, num_seqs)
        return
    got = policy.bucket_for(max_seqlen, num_seqs)
    # The smallest in both coordinates at once exists because the ladders are independent.
    assert got == Bucket(min(b.max_seqlen for b in fitting), min(b.capacity for b in fitting))
    assert got in policy.buckets()


def test_policy_listing():
    policy = BucketPolicy((256, 1024), [8, 32, 128])
    assert policy.capacity_ladder == (8, 32, 128)
    assert policy.num_buckets == 6 == len(policy.buckets()) == len(set(policy.buckets()))
    assert policy.buckets()[0] == Bucket(256, 8) and policy.buckets()[-1] == Bucket(1024, 128)
    text = policy.describe()
    assert "(256, 1024)" in text and "(8, 32, 128)" in text and "6 buckets" in text


@pytest.mark.parametrize(
    "seqlens, caps, match",
    [
        ((), (8,), "empty"),
        ((512, 256), (8,), "sorted"),
        ((256, 256), (8,), "sorted"),
        ((0, 256), (8,), "positive"),
        ((256,), (-8, 8), "positive"),
        ((256.0,), (8,), "ints"),
    ],
)
def test_policy_rejects_bad_ladders(seqlens, caps, match):
    with pytest.raises(ValueError, match=match):
        BucketPolicy(seqlens, caps)


def test_bucket_for_errors_say_what_to_change():
    policy = BucketPolicy((256, 512), (8, 32))
    with pytest.raises(ValueError, match=r"max_seqlen=600.*truncate documents to 512"):
        policy.bucket_for(600, 4)
    with pytest.raises(ValueError, match=r"40 sequences.*max_seqs_per_bin <= 32"):
        policy.bucket_for(100, 40)
    with pytest.raises(ValueError, match=">= 0"):
        policy.bucket_for(-1, 4)


@pytest.mark.parametrize("total_tokens", [1, 2, 5, 100, 255, 256, 257, 300, 512, 2048, 2049, 4096, 5000, 65536])
def test_default_buckets(total_tokens):
    policy = default_buckets(total_tokens)
    seqlens, caps = policy.max_seqlen_ladder, policy.capacity_ladder
    assert seqlens[-1] == total_tokens
    powers_of_four = [4**k for k in range(4, 10) if 4**k < total_tokens]  # 256, 1024, 4096, ...
    assert list(seqlens[:-1]) == powers_of_four
    # capacity: 8, 32, 128, ... (x4) below T, then T itself: every batch of at most T documents fits; up to
    # T=2048 a rung of 1 first (a batch of one document runs without ghost slots)
    lone = (1,) if 1 < total_tokens <= 2048 else ()
    assert caps == (*lone, *[8 * 4**k for k in range(12) if 8 * 4**k < total_tokens], total_tokens)
    if lone:
        assert policy.bucket_for(total_tokens, 1).capacity == 1 and policy.bucket_for(1, 2).capacity > 1
    assert policy.bucket_for(1, total_tokens).capacity == total_tokens
    assert policy.num_buckets <= 40, "default ladders must stay small"
    with pytest.raises(ValueError):
        default_buckets(0)


# ---------------------------------------------------------------------------------------------- apply
apply_cases = st.fixed_dictionaries(
    {
        "lengths": st.lists(st.integers(0, 40), max_size=12),
        "ghosts": st.integers(0, 20),
        "m": st.integers(1, 4),
        "seqlens": ladders.map(lambda t: (*t, 1000)),
        "caps": ladders.map(lambda t: (*t, 40)),
        "with_seq_idx": st.booleans(),
    }
)


def used_slots(lengths):
    """Slots up to the last one covering any row (trailing empty slots are ghosts)."""
    return max((i + 1 for i, n in enumerate(lengths) if n > 0), default=0)


@SETTINGS
@given(apply_cases)
def test_apply_repads_to_bucket(case):
    lengths, m = case["lengths"], case["m"]
    total = sum(-(-n // m) * m for n in lengths) + 3
    params = PackedSeqParams.from_seqlens(
        lengths, capacity=len(lengths) + case["ghosts"], total_tokens=total, pad_to_multiple=m, max_seqlen=total
    )
    if case["with_seq_idx"]:
        params = params.with_seq_idx()
    policy = BucketPolicy(tuple(sorted(set(case["seqlens"]))), tuple(sorted(set(case["caps"]))))
    used = used_slots(lengths)
    bucket = policy.bucket_for(max(lengths, default=0), used)
    out = policy.apply(params)
    ref = PackedSeqParams.from_seqlens(
        lengths[:used], capacity=bucket.capacity, total_tokens=total, pad_to_multiple=m, max_seqlen=bucket.max_seqlen
    )
    if case["with_seq_idx"]:
        ref = ref.with_seq_idx()
    assert out.equals(ref)
    assert out.max_seqlen_q == out.max_seqlen_kv == bucket.max_seqlen
    assert out.cu_seqlens_kv is out.cu_seqlens_q
    assert out.host_offsets == ref.host_offsets
    out.validate()
    assert policy.bucket_of(params) == bucket


def test_apply_without_host_offsets_only_grows():
    params = PackedSeqParams.from_seqlens([5, 3], capacity=10, total_tokens=20, max_seqlen=6)
    bare = params.replace(host_offsets=None)
    policy = BucketPolicy((4, 8, 16), (4, 16, 32))
    out = policy.apply(bare)
    # Bound from the params' own static values: max_seqlen 6 -> 8, capacity 10 -> 16 (not the true 2 -> 4).
    assert (out.max_seqlen_q, out.capacity) == (8, 16)
    assert out.cu_seqlens_q.tolist() == [0, 5, 8] + [8] * 14
    assert out.host_offsets is None
    out.validate()
    with_host = policy.apply(params)
    assert (with_host.max_seqlen_q, with_host.capacity) == (8, 4)


def test_apply_reads_no_device_values():
    # Meta tensors have no values: any .item()/.tolist()/sync in apply would raise here.
    params = PackedSeqParams.from_seqlens([7, 0, 2], capacity=5, total_tokens=16, pad_to_multiple=2, device="meta")
    params = params.with_seq_idx()
    policy = BucketPolicy((8, 16), (2, 4, 8))
    out = policy.apply(params)
    assert out.capacity == 4 and out.max_seqlen_q == 8
    assert out.cu_seqlens_q.device.type == "meta" and out.cu_seqlens_q.shape == (5,)
    assert out.cu_seqlens_q_padded.shape == (5,) and out.seq_idx.shape == (1, 16)
    assert out.host_offsets["cu_seqlens_q_padded"] == (0, 8, 8, 10, 10)
    grown = BucketPolicy((8, 16), (8,)).apply(params.replace(host_offsets=None))
    assert grown.cu_seqlens_q.shape == (9,) and grown.cu_seqlens_kv is grown.cu_seqlens_q


def test_apply_keeps_values_and_raises_when_nothing_fits():
    params = PackedSeqParams.from_seqlens([30, 2], capacity=2, total_tokens=40)
    with pytest.raises(ValueError, match="max_seqlen=30"):
        BucketPolicy((8, 16), (4,)).apply(params)
    out = BucketPolicy((32,), (4,)).apply(params)
    assert torch.equal(out.cu_seqlens_q[:3], params.cu_seqlens_q)
    assert out.cu_seqlens_q.tolist() == [0, 30, 32, 32, 32]


def test_stats_counts_batches_per_bucket():
    policy = BucketPolicy((4, 8), (2, 4))
    batches = [
        PackedBatch.from_documents(docs, bin_size=16, capacity=cap, max_seqlen=s)
        for docs, cap, s in [([[1, 2]], 2, 4), ([[1] * 7], 2, 8), ([[1], [2]], 2, 4), ([[3]], 8, 8)]
    ]
    counts = policy.stats(batches)
    naive = Counter((b.packed_seq_params.max_seqlen_q, b.packed_seq_params.capacity) for b in batches)
    assert {(k.max_seqlen, k.capacity): v for k, v in counts.items() if v} == dict(naive)
    assert list(counts)[:4] == policy.buckets() and counts[Bucket(4, 4)] == 0
    assert policy.stats([b.packed_seq_params for b in batches]) == counts


def test_geometric_ladder_ends_at_top():
    from packgraph.buckets import geometric_ladder

    assert geometric_ladder(256, 2048, 4) == (256, 1024, 2048)
    assert geometric_ladder(8, 64, 2) == (8, 16, 32, 64)
    assert geometric_ladder(256, 128, 2) == (128,)  # start past top: top alone


def test_capacity_ladder_gets_the_rung_below_the_short_docs_switch():
    """With ``short_docs_min_slots = m``, a ladder with rungs of m or more gets a rung of m - 1, so that no bucket
    takes batches on both sides of the switch; below m, with the switch off, or for the document mask's kernel
    (no switch), the ladder is kept."""
    off = BucketPolicy((64,), (8, 64, 1024), short_docs_min_slots=None)
    assert off.capacity_ladder == (8, 64, 1024) and off.bucket_for(10, 100).capacity == 1024
    policy = BucketPolicy((64,), (8, 64, 1024), short_docs_min_slots=513)
    assert policy.capacity_ladder == (8, 64, 512, 1024)
    assert policy.bucket_for(10, 100).capacity == 512 and policy.bucket_for(10, 513).capacity == 1024
    assert "(8, 64, 512, 1024)" in policy.describe()
    assert BucketPolicy((64,), (8, 64, 256), short_docs_min_slots=513).capacity_ladder == (8, 64, 256)
    every_call = BucketPolicy((64,), (8, 64, 1024), short_docs_min_slots=1)  # nothing to straddle
    assert every_call.capacity_ladder == (8, 64, 1024) and every_call.bucket_for(10, 100).capacity == 1024
    no_switch = BucketPolicy((64,), (8, 64, 1024), flash_kernels=False, short_docs_min_slots=513)
    assert no_switch.capacity_ladder == (8, 64, 1024)
