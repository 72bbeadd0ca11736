"""The embedded stdlib corpus, checked against reading the files directly."""

import math
import sysconfig
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packgraph.data.corpus import (
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    corpus_stats,
    decode,
    encode,
    load_corpus,
    source_files,
    stdlib_root,
)

ROOT = Path(sysconfig.get_paths()["stdlib"])
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def reference_files():
    """Every stdlib .py file outside third-party trees, by an independent walk (rglob)."""
    found = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if not SKIP_DIRS & set(rel.parts[:-1]) and path.is_file():
            found.append(rel.as_posix())
    return sorted(found)


def reference_docs(max_docs, append_eos=True):
    docs = []
    for rel in reference_files():
        data = (ROOT / rel).read_bytes()
        if data:
            docs.append(list(data) + ([EOS_ID] if append_eos else []))
        if len(docs) == max_docs:
            break
    return docs


def test_specials():
    assert EOS_ID == 256 and PAD_ID == 257 and VOCAB_SIZE == 258


def test_source_files_sorted_and_complete():
    files = source_files()
    assert stdlib_root() == ROOT
    assert list(files) == reference_files()
    assert len(files) > 100
    assert not any("site-packages" in f or "dist-packages" in f for f in files)


def test_load_corpus_matches_files_and_is_deterministic():
    docs = load_corpus(max_docs=60)
    assert [d.tolist() for d in docs] == reference_docs(60)
    assert all(d.dtype == torch.int64 and d.dim() == 1 for d in docs)
    again = load_corpus(max_docs=60)
    assert all(torch.equal(a, b) for a, b in zip(docs, again, strict=True))


def test_tokens_are_bytes_then_eos():
    for doc in load_corpus(max_docs=40):
        assert int(doc[-1]) == EOS_ID
        body = doc[:-1]
        assert int(body.min()) >= 0 and int(body.max()) < 256
    for doc in load_corpus(max_docs=40, append_eos=False):
        assert int(doc.max()) < 256


def test_caps_are_honoured():
    full = reference_docs(80)
    capped = load_corpus(max_docs=80, max_doc_len=100)
    assert len(capped) == 80
    for doc, ref in zip(capped, full, strict=True):
        want = ref if len(ref) <= 100 else ref[:99] + [EOS_ID]
        assert doc.tolist() == want
    no_eos = load_corpus(max_docs=80, max_doc_len=100, append_eos=False)
    assert [d.tolist() for d in no_eos] == [ref[:-1][:100] for ref in full]
    long_only = load_corpus(max_docs=30, min_doc_len=5000)
    want_long = [d for d in reference_docs(None) if len(d) >= 5000][:30]
    assert [d.tolist() for d in long_only] == want_long
    assert load_corpus(max_docs=0) == []
    with pytest.raises(ValueError):
        load_corpus(max_doc_len=0)


def test_full_corpus_is_heavy_tailed():
    docs = load_corpus()
    sizes = [(ROOT / rel).stat().st_size for rel in source_files()]
    assert len(docs) == sum(1 for s in sizes if s > 0)
    assert sum(len(d) for d in docs) == sum(sizes) + len(docs)
    stats = corpus_stats(docs)
    assert stats.max_len > 10 * stats.median_len


@settings(max_examples=60, deadline=None)
@given(st.text())
def test_encode_decode_round_trip(text):
    tokens = encode(text)
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == list(text.encode("utf-8"))
    assert decode(tokens) == text
    assert decode(torch.cat([tokens, torch.tensor([EOS_ID, PAD_ID])])) == text


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 500), max_size=50))
def test_corpus_stats(lengths):
    docs = [torch.zeros(n, dtype=torch.int64) for n in lengths]
    stats = corpus_stats(docs)
    if not lengths:
        assert (stats.count, stats.total_tokens, stats.max_len) == (0, 0, 0)
        return

    def nearest_rank(p):
        # The smallest length with at least a fraction p of the documents at or below it.
        return min(x for x in lengths if sum(1 for y in lengths if y <= x) >= math.ceil(p * len(lengths)))

    assert stats.count == len(lengths) and stats.total_tokens == sum(lengths)
    assert stats.min_len == min(lengths) and stats.max_len == max(lengths)
    assert stats.median_len == nearest_rank(0.5) and stats.p90_len == nearest_rank(0.9)
    assert str(stats).startswith(f"{len(lengths)} docs")
