"""The padded baseline: its loss and grads equal the packed model's, and its layout."""

import pytest
import torch

from packgraph.bench.padded import padded_batch, padded_loss
from packgraph.models.gpt import GPT, GPTConfig
from packgraph.packing import PackedBatch


@pytest.mark.parametrize("n_kv_head", [4, 2])
@pytest.mark.parametrize("padding_mask", [False, True])
def test_padded_loss_equals_packed_loss(n_kv_head, padding_mask):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_kv_head=n_kv_head)).double()
    lengths = [7, 1, 19, 3, 12]
    docs = [torch.randint(0, 256, (n,)) for n in lengths]
    batch = PackedBatch.from_documents(docs, bin_size=48, capacity=len(docs), max_seqlen=max(lengths))
    params = list(model.parameters())
    packed = model(batch)[1]  # reference: the packed model with its block-diagonal attention
    padded = padded_loss(model, padded_batch(batch), padding_mask=padding_mask)
    torch.testing.assert_close(padded, packed, rtol=1e-10, atol=1e-10)
    grads = zip(torch.autograd.grad(padded, params), torch.autograd.grad(packed, params), strict=True)
    for g_padded, g_packed in grads:
        torch.testing.assert_close(g_padded, g_packed, rtol=1e-8, atol=1e-10)


def test_padded_batch_layout():
    docs = [torch.arange(5), torch.arange(10, 13), torch.arange(20, 29)]
    batch = PackedBatch.from_documents(docs, bin_size=20, capacity=3, max_seqlen=9)
    pb = padded_batch(batch)
    assert pb.tokens.shape == (3, 9) and pb.lengths.tolist() == [5, 3, 9]
    for i, d in enumerate(docs):
        n = len(d)
        assert torch.equal(pb.tokens[i, :n], d)
        assert pb.labels[i, : n - 1].tolist() == d[1:].tolist()  # next token within the document
        assert (pb.labels[i, n - 1 :] == -100).all() and (pb.loss_mask[i, n - 1 :] == 0).all()
    assert pb.loss_mask.sum().item() == sum(len(d) - 1 for d in docs)
