"""The training data pipeline: corpus pieces, packing, bucketing and the deterministic, resumable data order."""

import pytest
import torch

from packgraph.data.corpus import load_corpus
from packgraph.data.stream import DataStream, corpus_documents, split_documents
from packgraph.train import TrainConfig


@pytest.mark.parametrize("multiple", [1, 4])
def test_labels_never_cross_documents(multiple):
    """Through the whole pipeline: every target is the next token of the same document, checked from offsets."""
    cfg = TrainConfig(T=512, max_docs=15, seed=3, pad_to_multiple=multiple)
    docs = corpus_documents(cfg)
    data = DataStream(docs, T=512, policy=cfg.bucket_policy(), seed=3, pad_to_multiple=multiple)
    checked = 0
    for _ in range(12):
        b = next(data)
        host = b.packed_seq_params.host_offsets
        real = host["cu_seqlens_q"]
        layout = host.get("cu_seqlens_q_padded", real)
        owner = torch.full((512,), -1)
        for i in range(len(b.doc_lengths)):
            n = real[i + 1] - real[i]
            owner[layout[i] : layout[i] + n] = i
        for r in range(512):
            if b.labels[r] != -100:
                assert r + 1 < 512 and owner[r] >= 0 and owner[r + 1] == owner[r], r
                assert b.labels[r] == b.tokens[r + 1]
                checked += 1
            elif owner[r] >= 0:
                assert r + 1 == 512 or owner[r + 1] != owner[r]  # only a document's last token lacks a target
        assert torch.equal(b.loss_mask, (b.labels != -100).float())
        assert b.loss_mask.sum() == b.num_real_tokens
        # Each document in the batch is one contiguous piece of a corpus file.
        for i in range(len(b.doc_lengths)):
            piece = b.tokens[layout[i] : layout[i] + real[i + 1] - real[i]]
            assert any(torch.equal(piece, d) for d in docs if d.numel() == piece.numel())
    assert checked > 12 * 400 // multiple


def test_split_documents_keeps_every_token():
    docs = load_corpus(max_docs=5)
    pieces = split_documents(docs, 300, min_len=40, seed=1)
    assert torch.equal(torch.cat(pieces), torch.cat(docs))
    assert all(1 <= p.numel() <= 300 for p in pieces)
    inner = [p.numel() for p in pieces if p.numel() < 40]
    assert len(inner) <= len(docs)  # only a file's last piece may be shorter than min_len
    assert [p.numel() for p in split_documents(docs, 300, min_len=40, seed=1)] == [p.numel() for p in pieces]
    want = []
    for d in docs:
        n = d.numel()
        want += [300] * (n // 300) + ([n % 300] if n % 300 else [])
    assert [p.numel() for p in split_documents(docs, 300)] == want


def test_data_stream_is_deterministic_and_visits_every_bin_once_per_epoch():
    cfg = TrainConfig(T=256, max_docs=6)
    docs = corpus_documents(cfg)
    a = DataStream(docs, T=256, policy=cfg.bucket_policy(), seed=5)
    b = DataStream(docs, T=256, policy=cfg.bucket_policy(), seed=5)
    n = a.bins_per_epoch
    seen = []
    for _ in range(n):
        x, y = next(a), next(b)
        assert torch.equal(x.tokens, y.tokens)
        seen.append(x.tokens)
    bins = {tuple(t.tolist()) for t in seen}
    assert len(bins) == n  # a permutation of the bins: nothing repeated or skipped
    first_of_epoch_1 = next(a)
    assert a.state_dict() == {"epoch": 1, "position": 1}
    assert tuple(first_of_epoch_1.tokens.tolist()) in bins
    # Restoring a position gives exactly the batch that came next.
    c = DataStream(docs, T=256, policy=cfg.bucket_policy(), seed=5)
    c.load_state_dict({"epoch": 0, "position": 3})
    assert torch.equal(next(c).tokens, seen[3])
    other = DataStream(docs, T=256, policy=cfg.bucket_policy(), seed=6)
    assert not all(torch.equal(next(other).tokens, s) for s in seen[:3])
