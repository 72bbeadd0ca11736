"""PackedBatch, samples and corpus batches, each checked against a naive reference (a per-document loop)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packgraph.buckets import BucketPolicy, default_buckets
from packgraph.data.corpus import PAD_ID, load_corpus
from packgraph.packing import (
    IGNORE_INDEX,
    PackedBatch,
    batches_from_corpus,
    fixed_shape_sample,
)

SETTINGS = settings(max_examples=80, deadline=None)


def footprint(n, m):
    return -(-n // m) * m


# ---------------------------------------------------------------------------------------------- PackedBatch
def naive_layout(docs, bin_size, m, pad_id):
    tokens = [pad_id] * bin_size
    labels = [IGNORE_INDEX] * bin_size
    pos = [0] * bin_size
    row = 0
    for doc in docs:
        for j, tok in enumerate(doc):
            tokens[row + j] = tok
            labels[row + j] = doc[j + 1] if j + 1 < len(doc) else IGNORE_INDEX
            pos[row + j] = j
        row += footprint(len(doc), m)
    return tokens, labels, pos


batch_cases = st.fixed_dictionaries(
    {
        "docs": st.lists(st.lists(st.integers(0, 255), max_size=20), max_size=6),
        "m": st.integers(1, 4),
        "extra_slots": st.integers(0, 3),
        "tail": st.integers(0, 7),
        "tensor_docs": st.booleans(),
    }
)


@SETTINGS
@given(batch_cases)
def test_from_documents_matches_per_document_loop(case):
    docs, m = case["docs"], case["m"]
    bin_size = sum(footprint(len(d), m) for d in docs) + case["tail"]
    if bin_size == 0:
        bin_size = 1
    capacity = max(len(docs) + case["extra_slots"], 1)
    inputs = [torch.tensor(d, dtype=torch.int32) for d in docs] if case["tensor_docs"] else docs
    batch = PackedBatch.from_documents(inputs, bin_size=bin_size, capacity=capacity, pad_to_multiple=m)
    tokens, labels, pos = naive_layout(docs, bin_size, m, PAD_ID)
    assert batch.tokens.tolist() == tokens and batch.tokens.dtype == torch.int64
    assert batch.labels.tolist() == labels and batch.labels.dtype == torch.int64
    assert batch.position_ids.tolist() == pos and batch.position_ids.dtype == torch.int64
    assert batch.loss_mask.dtype == torch.float32
    assert batch.loss_mask.tolist() == [float(lab != IGNORE_INDEX) for lab in labels]
    assert batch.total_tokens == bin_size and batch.capacity == capacity and batch.max_seqlen == bin_size
    assert batch.num_docs == len(docs)
    assert batch.num_real_tokens == sum(max(len(d) - 1, 0) for d in docs) == int(batch.loss_mask.sum())
    params = batch.packed_seq_params.validate()
    offsets, padded = [0], [0]
    for d in docs:
        offsets.append(offsets[-1] + len(d))
        padded.append(padded[-1] + footprint(len(d), m))
    ghosts = capacity - len(docs)
    assert params.cu_seqlens_q.tolist() == offsets + [offsets[-1]] * ghosts
    if m > 1:
        assert params.cu_seqlens_q_padded.tolist() == padded + [padded[-1]] * ghosts
    else:
        assert params.cu_seqlens_q_padded is None
    assert params.total_tokens == bin_size and params.host_offsets is not None


def test_labels_never_cross_documents():
    docs = [[1, 2, 3], [4], [5, 6]]
    batch = PackedBatch.from_documents(docs, bin_size=9, capacity=4)
    # Row 2 (doc 0's last) must not predict 4 (doc 1's first); row 3 (doc 1, one token) has no target.
    assert batch.labels.tolist() == [2, 3, -100, -100, 6, -100, -100, -100, -100]
    assert batch.position_ids.tolist() == [0, 1, 2, 0, 0, 1, 0, 0, 0]


def test_from_documents_errors():
    with pytest.raises(ValueError, match="bin_size"):
        PackedBatch.from_documents([[1] * 5, [2] * 5], bin_size=12, capacity=2, pad_to_multiple=4)
    with pytest.raises(ValueError, match="capacity"):
        PackedBatch.from_documents([[1], [2], [3]], bin_size=8, capacity=2)
    with pytest.raises(ValueError, match="max_seqlen"):
        PackedBatch.from_documents([[1] * 5], bin_size=8, capacity=2, max_seqlen=4)
    with pytest.raises(ValueError, match="1-D"):
        PackedBatch.from_documents([torch.zeros(2, 2, dtype=torch.long)], bin_size=8, capacity=2)


def test_signature_equal_within_a_bucket():
    a = PackedBatch.from_documents([[1, 2, 3], [4, 5]], bin_size=16, capacity=4, max_seqlen=8, pad_to_multiple=2)
    b = PackedBatch.from_documents([[7] * 8, [], [9]], bin_size=16, capacity=4, max_seqlen=8, pad_to_multiple=2)
    sample = fixed_shape_sample(16, 4, max_seqlen=8, pad_to_multiple=2, seed=3)
    assert a.static_signature() == b.static_signature() == sample.static_signature()
    for x in (b, sample):
        for name in ("tokens", "labels", "loss_mask", "position_ids"):
            assert getattr(x, name).shape == getattr(a, name).shape
            assert getattr(x, name).dtype == getattr(a, name).dtype
    other = PackedBatch.from_documents([[1, 2, 3], [4, 5]], bin_size=16, capacity=8, max_seqlen=8, pad_to_multiple=2)
    assert other.static_signature() != a.static_signature()


def test_to_moves_everything_and_keeps_host_data():
    batch = PackedBatch.from_documents([[1, 2, 3], [4, 5]], bin_size=8, capacity=3)
    moved = batch.to("meta")
    for name in ("tokens", "labels", "loss_mask", "position_ids"):
        assert getattr(moved, name).device.type == "meta"
        assert getattr(moved, name).shape == getattr(batch, name).shape
    params = moved.packed_seq_params
    assert params.cu_seqlens_q.device.type == "meta" and params.cu_seqlens_kv is params.cu_seqlens_q
    assert params.host_offsets == batch.packed_seq_params.host_offsets
    assert moved.num_real_tokens == 3 and moved.num_docs == 2


# ---------------------------------------------------------------------------------------------- samples
@SETTINGS
@given(
    bin_size=st.integers(1, 300),
    capacity=st.integers(1, 20),
    max_seqlen=st.none() | st.integers(1, 300),
    m=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_fixed_shape_sample(bin_size, capacity, max_seqlen, m, seed):
    sample = fixed_shape_sample(bin_size, capacity, max_seqlen=max_seqlen, pad_to_multiple=m, seed=seed)
    lengths = sample.doc_lengths
    longest = bin_size if max_seqlen is None else min(max_seqlen, bin_size)
    assert len(lengths) == capacity
    assert all(0 <= n <= longest for n in lengths)
    used_units = sum(footprint(n, m) for n in lengths) // m
    assert used_units == min(bin_size // m, capacity * -(-longest // m)), "the sample does not fill the bin"
    if bin_size // m >= capacity:
        assert min(lengths) >= 1
    assert int(sample.tokens.max()) < 258
    empty = PackedBatch.from_documents(
        [], bin_size=bin_size, capacity=capacity, max_seqlen=max_seqlen, pad_to_multiple=m
    )
    assert sample.static_signature() == empty.static_signature()
    again = fixed_shape_sample(bin_size, capacity, max_seqlen=max_seqlen, pad_to_multiple=m, seed=seed)
    assert torch.equal(again.tokens, sample.tokens) and again.doc_lengths == lengths


def test_fixed_shape_sample_small_vocab_and_device():
    sample = fixed_shape_sample(64, 4, vocab_size=10, device="meta")
    assert sample.tokens.device.type == "meta"
    cpu = fixed_shape_sample(64, 4, vocab_size=10)
    assert int(cpu.tokens.max()) < 10 and int(cpu.tokens.min()) >= 0


# ---------------------------------------------------------------------------------------------- corpus -> batches
def rows_of_docs(batch):
    """Recover the documents of a batch from its host offsets (a per-document read-out)."""
    host = batch.packed_seq_params.host_offsets
    starts = host.get("cu_seqlens_q_padded", host["cu_seqlens_q"])
    return [batch.tokens[starts[i] : starts[i] + n].tolist() for i, n in enumerate(batch.doc_lengths)]


@pytest.mark.parametrize("m", [1, 4])
def test_batches_from_corpus_covers_every_document(m):
    gen = torch.Generator().manual_seed(0)
    lengths = (torch.rand(120, generator=gen) ** 3 * 700).long().tolist()
    docs = [torch.randint(0, 256, (n,), generator=gen) for n in lengths]
    policy = BucketPolicy((64, 128, 256), (4, 16))
    batches = batches_from_corpus(docs, bin_size=256, policy=policy, pad_to_multiple=m)
    packing = batches.packing
    assert len(batches) == len(packing)
    seen = []
    for bin_docs, batch in zip(packing, batches, strict=True):
        got = rows_of_docs(batch)
        assert got == [docs[i][: packing.lengths[i]].tolist() for i in bin_docs]
        seen.extend(bin_docs)
        true_max, n = max(packing.lengths[i] for i in bin_docs), len(bin_docs)
        assert batch.max_seqlen == min(v for v in policy.max_seqlen_ladder if v >= true_max)
        assert batch.capacity == min(v for v in policy.capacity_ladder if v >= n)
        assert batch.total_tokens == 256
        batch.packed_seq_params.validate()
    assert sorted(seen) == list(range(len(docs)))
    assert packing.truncated == tuple(i for i, n in enumerate(lengths) if n > 256 - (256 % m))
    assert len(batches) == 0


def test_batches_from_corpus_caps_at_policy_max_seqlen():
    docs = [torch.arange(n) % 256 for n in (10, 100, 40)]
    policy = BucketPolicy((32, 64), (4,))
    batches = batches_from_corpus(docs, bin_size=128, policy=policy)
    assert batches.packing.lengths == (10, 64, 40) and batches.packing.truncated == (1,)
    assert all(b.max_seqlen <= 64 for b in batches)
    with pytest.raises(ValueError, match="max_seqlen 64"):
        batches_from_corpus(docs, bin_size=128, policy=policy, overlong="raise")
    with pytest.raises(ValueError, match="largest capacity"):
        batches_from_corpus(docs, bin_size=128, policy=policy, max_seqs_per_bin=8)


def test_batches_from_real_corpus():
    docs = load_corpus(max_docs=40)
    policy = default_buckets(4096)
    batches = list(batches_from_corpus(docs, bin_size=4096, policy=policy, algorithm="bfd"))
    total = sum(b.num_real_tokens + b.num_docs for b in batches)  # each doc contributes len - 1 targets
    truncated = [min(len(d), 4096) for d in docs]
    assert total == sum(truncated)
    assert sum(policy.stats(batches).values()) == len(batches)
