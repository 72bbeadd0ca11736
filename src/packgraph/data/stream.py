"""The deterministic data order: documents cut from the corpus, packed once, visited in seeded epochs.

corpus (files cut into pieces of random, seeded length, see :func:`split_documents`) -> ``batches_from_corpus``
(packed once, bucketed by the policy) -> each epoch visits the bins in an order shuffled by ``(seed, epoch)``.
The data position is ``(epoch, bin index)``, so a checkpoint resumes on the very next batch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from typing import Protocol

from torch import Tensor

from packgraph.buckets import BucketPolicy
from packgraph.data.corpus import load_corpus
from packgraph.packing import CorpusBatches, PackedBatch, Packing, batches_from_corpus

__all__ = ["CorpusSpec", "DataStream", "corpus_documents", "split_documents"]


class CorpusSpec(Protocol):
    """The fields of a :class:`packgraph.train.TrainConfig` that choose the training documents.

    A protocol so this module need not import :mod:`packgraph.train` (imports flow train -> data.stream).
    """

    T: int
    max_docs: int | None
    chunk_len: int | None
    min_chunk_len: int | None
    seed: int

    def bucket_policy(self) -> BucketPolicy: ...


def split_documents(docs: Sequence[Tensor], max_len: int, *, min_len: int | None = None, seed: int = 0) -> list[Tensor]:
    """Cut each document into consecutive pieces (views, in order); every token is kept.

    Piece lengths are drawn log-uniformly from ``[min_len, max_len]`` with a ``random.Random(seed)`` (the last
    piece of a document takes the remainder), so a corpus of long files becomes a heavy-tailed mix of short and
    long documents, like SFT or RL data, and bins hold several documents. ``min_len=None`` (or ``== max_len``)
    cuts fixed ``max_len`` pieces.
    """
    if max_len < 1 or (min_len is not None and not 1 <= min_len <= max_len):
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    rng = random.Random(seed)
    lo, hi = math.log(min_len or max_len), math.log(max_len)
    out: list[Tensor] = []
    for d in docs:
        start, n = 0, d.numel()
        while start < n:
            size = max_len if min_len is None else int(math.exp(rng.uniform(lo, hi)))
            out.append(d[start : start + size])
            start += size
    return out


def corpus_documents(cfg: CorpusSpec) -> list[Tensor]:
    """The training documents of ``cfg``: the embedded corpus (``max_docs`` files) cut by :func:`split_documents`
    into pieces of ``[min_chunk_len, chunk_len]`` tokens (``chunk_len`` defaults to the largest max_seqlen rung).
    """
    max_len = min(cfg.chunk_len or cfg.T, cfg.bucket_policy().max_seqlen)
    min_len = None if cfg.min_chunk_len is None else min(cfg.min_chunk_len, max_len)
    return split_documents(load_corpus(max_docs=cfg.max_docs), max_len, min_len=min_len, seed=cfg.seed)


class DataStream:
    """Endless deterministic batches. Packs ``docs`` once; epoch ``e`` visits the bins shuffled by ``(seed, e)``.

    ``state_dict()`` is ``{"epoch", "position"}``; loading it makes the next batch exactly the one that would have
    come next (no batch is rebuilt to skip ahead).
    """

    def __init__(
        self,
        docs: Sequence[Tensor],
        *,
        T: int,
        policy: BucketPolicy,
        seed: int = 0,
        algorithm: str = "ffd",
        pad_to_multiple: int = 1,
    ) -> None:
        if not docs:
            raise ValueError("no documents to train on")
        self.docs = docs
        self.policy = policy
        self.seed = seed
        self.pad_to_multiple = pad_to_multiple
        self.packing: Packing = batches_from_corpus(
            docs, bin_size=T, policy=policy, algorithm=algorithm, pad_to_multiple=pad_to_multiple
        ).packing
        self.epoch = 0
        self.position = 0
        self._batches: Iterator[PackedBatch] | None = None

    @property
    def bins_per_epoch(self) -> int:
        return len(self.packing)

    def _bin_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.packing)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def _open(self) -> Iterator[PackedBatch]:
        order = self._bin_order(self.epoch)[self.position :]
        p = self.packing
        epoch_packing = Packing(
            [p[i] for i in order],
            bin_size=p.bin_size,
            lengths=p.lengths,
            truncated=p.truncated,
            algorithm=p.algorithm,
            multiple=p.multiple,
            max_seqs_per_bin=p.max_seqs_per_bin,
        )
        return CorpusBatches(self.docs, epoch_packing, self.policy, self.pad_to_multiple)

    def __iter__(self) -> DataStream:
        return self

    def __next__(self) -> PackedBatch:
        if self.position >= len(self.packing):
            self.epoch, self.position, self._batches = self.epoch + 1, 0, None
        if self._batches is None:
            self._batches = self._open()
        batch = next(self._batches)
        self.position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self._batches = int(state["epoch"]), int(state["position"]), None
