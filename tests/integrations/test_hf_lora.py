"""LoRA through PEFT on graphed decoder layers: frozen base weights (the embedding too) and trainable adapters.
Against the same PEFT model run packed and eager: adapter grads and losses are eager's over AdamW steps, and no
frozen weight gets a ``.grad``. The whole PEFT model goes to ``graph_decoder_layers`` as users hold it."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from packgraph.graphs import use_recorder  # noqa: E402
from packgraph.integrations import hf  # noqa: E402
from tests.eager_recorder import EagerRecorder  # noqa: E402
from tests.integrations.hf_docs import TOTAL_TOKENS  # noqa: E402
from tests.integrations.hf_docs import collate as _collate  # noqa: E402
from tests.integrations.hf_docs import docs as _docs  # noqa: E402
from tests.integrations.test_hf import _configs, _model  # noqa: E402


def _lora_model():
    model = _model(_configs()["llama"], "packgraph").train().double()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    lora = peft.get_peft_model(model, config)
    torch.manual_seed(1)
    for name, p in lora.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero: give the adapters something to train through
            torch.nn.init.normal_(p, std=0.1)
    return lora


@pytest.mark.parametrize("scope", ["layer", "attn", "mlp"])
def test_lora_adapters_train_as_in_eager_and_frozen_weights_get_no_grad(scope):
    ref = _lora_model()
    model = copy.deepcopy(ref)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    batches = [
        hf.from_flattening_batch(_collate(_docs(lengths, seed)), total_tokens=TOTAL_TOKENS)
        for seed, lengths in enumerate([(20, 5, 13), (40,), (3,) * 12])
    ]
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (ref, model)]
    with use_recorder(EagerRecorder()):
        handle = hf.graph_decoder_layers(model, batches[0], scope=scope)
        for step in range(6):
            batch = batches[step % len(batches)]
            losses = []
            for m, opt in ((ref, opts[0]), (model, opts[1])):
                opt.zero_grad(set_to_none=True)
                out = hf.packed_forward(m, batch, compute_loss=True)
                out.loss.backward()
                losses.append(out.loss.detach())
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-10, atol=1e-12, msg=f"step {step}")
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                assert (p.grad is None) == (q.grad is None) == (not p.requires_grad), name
                if p.grad is not None:
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=f"step {step} {name}")
            for opt in opts:
                opt.step()
        handle.remove()
