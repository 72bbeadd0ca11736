"""Batch conversion (packgraph.integrations.hf_batches) on the CPU, against transformers' own collator.

References are label/position layouts written out by hand and the collator's own output (round trips).
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from packgraph.buckets import BucketPolicy  # noqa: E402
from packgraph.integrations.hf_batches import from_flattening_batch, to_flattening_batch  # noqa: E402
from tests.integrations.hf_docs import DOC_LENGTHS, TOTAL_TOKENS  # noqa: E402
from tests.integrations.hf_docs import collate as _collate  # noqa: E402
from tests.integrations.hf_docs import docs as _docs  # noqa: E402


def _hand_layout(docs, total):
    """Shifted labels and restarting positions written out row by row."""
    labels, positions = [], []
    for d in docs:
        for j in range(len(d)):
            labels.append(int(d[j + 1]) if j + 1 < len(d) else -100)
            positions.append(j)
    pad = total - len(labels)
    return torch.tensor(labels + [-100] * pad), torch.tensor(positions + [0] * pad)


@pytest.mark.parametrize(
    "collator_kwargs",
    [{}, {"return_flash_attn_kwargs": True}, {"return_seq_idx": True}, {"return_flash_attn_kwargs": True,
     "return_seq_idx": True}],
)  # fmt: skip
def test_from_flattening_batch_layout(collator_kwargs):
    docs = _docs()
    batch = from_flattening_batch(_collate(docs, **collator_kwargs), total_tokens=TOTAL_TOKENS, pad_token_id=3)
    labels, positions = _hand_layout(docs, TOTAL_TOKENS)
    n = sum(DOC_LENGTHS)
    assert torch.equal(batch.tokens[:n], torch.cat(docs)) and (batch.tokens[n:] == 3).all()
    assert torch.equal(batch.labels, labels)
    assert torch.equal(batch.loss_mask, (labels != -100).float())
    assert torch.equal(batch.position_ids, positions)
    params = batch.packed_seq_params
    assert params.cu_seqlens_q.tolist() == [0, 5, 22, 23, 32, 44]
    assert params.cu_seqlens_q.dtype == torch.int32
    assert (params.max_seqlen_q, params.total_tokens, params.capacity) == (17, TOTAL_TOKENS, 5)
    assert batch.doc_lengths == DOC_LENGTHS and batch.num_real_tokens == int(batch.loss_mask.sum())


def test_from_flattening_batch_buckets_and_masked_labels():
    docs = _docs()
    features = []
    for d in docs:  # prompt masking: the first half of each document carries no loss
        lab = d.clone()
        lab[: len(d) // 2] = -100
        features.append({"input_ids": d.tolist(), "labels": lab.tolist()})
    collated = transformers.DataCollatorWithFlattening()(features)
    policy = BucketPolicy((8, 32, 64), (4, 8, 16))
    batch = from_flattening_batch(collated, buckets=policy, total_tokens=64)
    params = batch.packed_seq_params
    assert (params.max_seqlen_q, params.max_seqlen_kv, params.capacity) == (32, 32, 8)
    assert params.cu_seqlens_q.tolist() == [0, 5, 22, 23, 32, 44, 44, 44, 44]
    expected = torch.full((64,), -100)
    start = 0
    for d in docs:
        for j in range(len(d) - 1):
            if j + 1 >= len(d) // 2:  # the target token j + 1 is in the unmasked half
                expected[start + j] = d[j + 1]
        start += len(d)
    assert torch.equal(batch.labels, expected)
    assert batch.doc_lengths is None  # masked labels: the target count is not sum(len - 1)
    assert batch.num_real_tokens == int((expected != -100).sum())
    back = to_flattening_batch(batch, return_flash_attn_kwargs=False)
    assert torch.equal(back["labels"], collated["labels"])


@pytest.mark.parametrize("return_seq_idx", [False, True])
def test_flattening_round_trip(return_seq_idx):
    collated = _collate(_docs(), return_flash_attn_kwargs=True, return_seq_idx=return_seq_idx)
    batch = from_flattening_batch(collated, total_tokens=TOTAL_TOKENS)
    back = to_flattening_batch(batch, return_seq_idx=return_seq_idx)
    assert set(back) == set(collated)
    for key, value in collated.items():
        if isinstance(value, torch.Tensor):
            assert back[key].dtype == value.dtype, key
            assert torch.equal(back[key], value), key
        else:
            assert back[key] == value, key


def test_to_flattening_batch_padded_layout():
    """Documents placed at padded offsets (pad_to_multiple) come back contiguous, in order."""
    from packgraph.packing import PackedBatch

    docs = _docs((3, 6, 2))
    batch = PackedBatch.from_documents(docs, bin_size=24, capacity=4, pad_to_multiple=4)
    assert batch.packed_seq_params.cu_seqlens_q_padded is not None
    back = to_flattening_batch(batch)
    assert torch.equal(back["input_ids"][0], torch.cat(docs))
    assert back["cu_seq_lens_q"].tolist() == [0, 3, 9, 11] and back["max_length_q"] == 6
    expected = torch.cat([torch.cat([torch.tensor([-100]), d[1:]]) for d in docs])
    assert torch.equal(back["labels"][0], expected)


def test_from_flattening_batch_errors():
    collated = _collate(_docs())
    with pytest.raises(ValueError, match="more than total_tokens"):
        from_flattening_batch(collated, total_tokens=10)
    bad = dict(collated, cu_seq_lens_q=torch.tensor([0, 5, 99], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        from_flattening_batch(bad)
    with pytest.raises(ValueError, match="position_ids must be"):
        from_flattening_batch(dict(collated, position_ids=collated["position_ids"][:, :-1]))
