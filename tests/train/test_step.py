"""One step's parts: gradient accumulation equals one big batch; the deterministic-kernels mode."""

import pytest
import torch
import torch.nn.functional as F

from packgraph.data.stream import DataStream, corpus_documents
from packgraph.models.gpt import GPT
from packgraph.train import TrainConfig, accumulate_gradients


def test_grad_accumulation_equals_one_big_batch():
    cfg = TrainConfig(T=128, max_docs=4, seed=1)
    data = DataStream(corpus_documents(cfg), T=128, policy=cfg.bucket_policy(), seed=1)
    micro = [next(data) for _ in range(3)]
    torch.manual_seed(0)
    model = GPT(cfg.model_config()).double()
    loss = accumulate_gradients(model, micro, torch.device("cpu"))
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    # Reference: CE summed over every target of the three batches, divided by their count.
    model.zero_grad(set_to_none=True)
    ce_sum, count = 0.0, 0
    for b in micro:
        logits = model(b.tokens, b.packed_seq_params)
        ce_sum = ce_sum + F.cross_entropy(logits, b.labels, ignore_index=-100, reduction="sum")
        count += int((b.labels != -100).sum())
    ref = ce_sum / count
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-9, atol=1e-12, msg=n)


def test_deterministic_kernels_mode_is_set_inside_and_restored_after():
    from packgraph.train import deterministic_kernels

    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_kernels(True):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # warn-only keeps FA's atomics
    assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(RuntimeError, match="boom"), deterministic_kernels(True):
        raise RuntimeError("boom")
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_kernels(False):
        assert not torch.are_deterministic_algorithms_enabled()
