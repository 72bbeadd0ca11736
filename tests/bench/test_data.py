"""Batch streams: exact metadata, determinism, the tour of every bucket."""

import pytest
import torch

from packgraph.bench.data import batch_stream, doc_tokens, stream_stats
from packgraph.buckets import default_buckets


@pytest.mark.parametrize("mix", ["corpus", "short", "long"])
def test_batch_stream_has_exact_metadata(mix):
    T = 256
    stream = batch_stream(mix, T, 6, seed=3, max_corpus_docs=32)
    again = batch_stream(mix, T, 6, seed=3, max_corpus_docs=32)
    policy = default_buckets(T)
    for b, b2 in zip(stream, again, strict=True):
        assert torch.equal(b.tokens, b2.tokens)  # deterministic
        params = b.packed_seq_params
        assert b.total_tokens == T and sum(b.doc_lengths) <= T
        assert params.capacity == len(b.doc_lengths) and params.max_seqlen_q == max(b.doc_lengths)
        policy.bucket_for(max(b.doc_lengths), len(b.doc_lengths))  # every batch fits the default policy
        assert [len(d) for d in doc_tokens(b)] == list(b.doc_lengths)
    stats = stream_stats(mix, T, stream, policy)
    assert stats.batches == 6
    assert stats.docs_per_batch == pytest.approx(sum(len(b.doc_lengths) for b in stream) / 6)
    assert stats.distinct_buckets <= stats.distinct_exact_signatures
    if mix == "long":
        assert all(len(b.doc_lengths) <= 8 for b in stream)  # documents of at least T/8 tokens


def test_bucket_tour_visits_every_reachable_bucket():
    T = 1024
    policy = default_buckets(T)
    # every (longest document, document count) a batch of T rows can have, and the buckets they land in
    reachable = {policy.bucket_for(longest, n) for n in range(1, T + 1) for longest in range(1, T - n + 2)}
    stream = batch_stream("buckets", T, 2 * len(reachable), max_corpus_docs=8)
    assert all(b.tokens.shape == (T,) for b in stream)
    assert {policy.bucket_of(b.packed_seq_params) for b in stream} == reachable


def test_bucket_tour_follows_the_ladder_it_is_given():
    from packgraph.bench.presets import ladder_policy

    T = 1024
    policy = ladder_policy("capacity-x2", T)
    reachable = {policy.bucket_for(longest, n) for n in range(1, T + 1) for longest in range(1, T - n + 2)}
    stream = batch_stream("buckets", T, 2 * len(reachable), policy=policy, max_corpus_docs=8)
    assert {policy.bucket_of(b.packed_seq_params) for b in stream} == reachable
    assert len(reachable) > len({default_buckets(T).bucket_of(b.packed_seq_params) for b in stream})
