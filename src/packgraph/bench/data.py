"""Length mixes and batch streams for ``packgraph bench``.

A *stream* is a deterministic list of host-side :class:`~packgraph.packing.PackedBatch` es of ``T`` rows, each
built with its **exact** metadata: capacity = its number of documents, ``max_seqlen`` = its longest document.
That is what eager runs with; every other method derives its own input from the same batches (a bucket, a
padded ``[B, L]`` layout), so all methods see the same documents.

Mixes:

* ``corpus``: the embedded corpus (stdlib sources), heavy-tailed; documents longer than ``T`` are truncated.
* ``short``: many short documents (log-normal lengths, median 128 tokens, clipped to [8, 1024]).
* ``long``: a few long documents (uniform lengths in [T/8, T]).
* ``buckets``: a tour of the bucket ladder: batch ``i`` lands in the ``i``-th reachable bucket of the policy
  (in a seeded order, cycling), so a stream of ``n >= buckets`` batches captures every graph the policy can need.

Synthetic documents are slices of the corpus' token stream, so their contents are real text. Bins are packed
first-fit decreasing under the default bucket policy's largest capacity, then sampled in a seeded random order
(FFD emits its bins longest-first; sampling mixes them as a shuffled loader would).
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from packgraph.buckets import BucketPolicy, default_buckets
from packgraph.data.corpus import load_corpus
from packgraph.packing import PackedBatch, pack_sequences

__all__ = ["MIXES", "StreamStats", "batch_stream", "doc_tokens", "mix_documents", "stream_stats"]

MIXES: tuple[str, ...] = ("corpus", "short", "long", "buckets")


@functools.lru_cache(maxsize=4)
def _corpus(max_docs: int | None) -> tuple[Tensor, ...]:
    return tuple(load_corpus(max_docs=max_docs))


@functools.lru_cache(maxsize=4)
def _corpus_text(max_docs: int | None, max_tokens: int = 1 << 22) -> Tensor:
    """The corpus as one token stream, capped (synthetic documents only need real text, not all of it)."""
    parts, total = [], 0
    for d in _corpus(max_docs):
        parts.append(d)
        total += d.numel()
        if total >= max_tokens:
            break
    return torch.cat(parts)


def mix_documents(
    mix: str, T: int, num_tokens: int, *, seed: int = 0, max_corpus_docs: int | None = None
) -> list[Tensor]:
    """Documents (int64 ``[len]`` token tensors) of one mix, for batches of ``T`` rows.

    ``corpus`` returns the whole corpus (``max_corpus_docs`` caps it); the synthetic mixes return documents
    until they hold at least ``num_tokens`` tokens.

    Raises:
        ValueError: unknown mix (the message lists the known ones).
    """
    corpus = _corpus(max_corpus_docs)
    if mix in ("corpus", "buckets"):
        return list(corpus)
    rng = random.Random(f"{mix}-{T}-{seed}")
    if mix == "short":

        def draw() -> int:
            return int(min(max(rng.lognormvariate(math.log(128), 0.75), 8), min(1024, T)))
    elif mix == "long":

        def draw() -> int:
            return rng.randint(max(T // 8, 1), T)
    else:
        raise ValueError(f"unknown mix {mix!r}; choose from {MIXES}")
    text = _corpus_text(max_corpus_docs)
    docs, total = [], 0
    while total < num_tokens:
        n = min(draw(), text.numel())
        start = rng.randrange(text.numel() - n + 1)
        docs.append(text[start : start + n])
        total += n
    return docs


def doc_tokens(batch: PackedBatch) -> list[Tensor]:
    """The documents of a host-side packed batch (no padded twins), in stream order."""
    offsets = batch.packed_seq_params.host_offsets["cu_seqlens_q"]
    n = len(batch.doc_lengths) if batch.doc_lengths is not None else len(offsets) - 1
    return [batch.tokens[offsets[i] : offsets[i + 1]] for i in range(n)]


def batch_stream(
    mix: str,
    T: int,
    n: int,
    *,
    seed: int = 0,
    policy: BucketPolicy | None = None,
    max_corpus_docs: int | None = None,
) -> list[PackedBatch]:
    """``n`` host-side batches of ``T`` rows with exact metadata (capacity = documents, max_seqlen = true max).

    Bins hold at most ``policy.max_capacity`` documents (``default_buckets(T)`` when ``policy`` is None), so
    every batch fits the policy. Deterministic for a given (mix, T, n, seed, corpus).
    """
    policy = policy or default_buckets(T)
    if mix == "buckets":
        return _bucket_tour(T, n, policy, seed=seed, max_corpus_docs=max_corpus_docs)
    docs = mix_documents(mix, T, num_tokens=int(1.25 * (n + 2) * T), seed=seed, max_corpus_docs=max_corpus_docs)
    lengths = [min(len(d), policy.max_seqlen, T) for d in docs]
    packing = pack_sequences(lengths, T, max_seqs_per_bin=policy.max_capacity, overlong="truncate")
    rng = random.Random(f"stream-{mix}-{T}-{seed}")
    order = list(range(len(packing)))
    rng.shuffle(order)
    while len(order) < n:  # a small corpus (dry runs) has fewer bins than batches: reuse them
        order += order[: n - len(order)]
    stream = []
    for b in order[:n]:
        bin_docs = [docs[i][: packing.lengths[i]] for i in packing[b]]
        # a stream order within the bin that is not sorted by length, as a loader would give
        rng.shuffle(bin_docs)
        longest = max((len(d) for d in bin_docs), default=1)
        stream.append(PackedBatch.from_documents(bin_docs, bin_size=T, capacity=len(bin_docs), max_seqlen=longest))
    return stream


def _bucket_tour(T: int, n: int, policy: BucketPolicy, *, seed: int, max_corpus_docs: int | None) -> list[PackedBatch]:
    """``n`` batches that visit every bucket a batch of ``T`` rows can reach: bucket ``(S, C)`` gets a longest
    document just over the rung below ``S`` and one more document than the rung below ``C`` (the rest 1 token)."""
    seqlens, caps = (0, *policy.max_seqlen_ladder), (0, *policy.capacity_ladder)
    reachable = [
        (seqlens[i - 1] + 1, caps[j - 1] + 1)
        for i in range(1, len(seqlens))
        for j in range(1, len(caps))
        if seqlens[i - 1] + 1 + caps[j - 1] <= T
    ]
    rng = random.Random(f"stream-buckets-{T}-{seed}")
    rng.shuffle(reachable)
    text = _corpus_text(max_corpus_docs)
    stream = []
    for k in range(n):
        longest, count = reachable[k % len(reachable)]
        lengths = [longest] + [1] * (count - 1)
        start = rng.randrange(max(1, text.numel() - T))
        tokens = text[start : start + sum(lengths)]
        docs = list(torch.split(tokens, lengths))
        rng.shuffle(docs)
        stream.append(PackedBatch.from_documents(docs, bin_size=T, capacity=count, max_seqlen=longest))
    return stream


@dataclass(frozen=True)
class StreamStats:
    """What a stream looks like: documents per batch, real-token fraction, how many static signatures."""

    T: int
    mix: str
    batches: int
    docs_per_batch: float
    max_seqlen_mean: float
    real_token_fraction: float
    distinct_buckets: int
    distinct_exact_signatures: int


def stream_stats(mix: str, T: int, stream: Sequence[PackedBatch], policy: BucketPolicy | None = None) -> StreamStats:
    """Host-only statistics of ``stream`` under ``policy`` (``default_buckets(T)`` when None).

    ``distinct_buckets`` is the number of graph sets a bucketed graph engine needs for the stream;
    ``distinct_exact_signatures`` the number of (capacity, max_seqlen) pairs an exact-metadata cache would see.
    """
    policy = policy or default_buckets(T)
    lengths = [b.doc_lengths for b in stream]
    buckets = {policy.bucket_for(max(ls, default=0), len(ls)) for ls in lengths}
    exact = {(len(ls), max(ls, default=0)) for ls in lengths}
    k = max(len(stream), 1)
    return StreamStats(
        T=T,
        mix=mix,
        batches=len(stream),
        docs_per_batch=sum(len(ls) for ls in lengths) / k,
        max_seqlen_mean=sum(max(ls, default=0) for ls in lengths) / k,
        real_token_fraction=sum(sum(ls) for ls in lengths) / (k * T),
        distinct_buckets=len(buckets),
        distinct_exact_signatures=len(exact),
    )
