"""``transformers.Trainer`` on the H200: graphed vs packed eager (equal losses), and tokens/s against HF's padded path.

A Llama (d=512, 8 layers, GQA 8/4 heads) trained by the real ``Trainer`` with ``bf16=True`` (autocast over float32
weights, as HF's recipe does) on the embedded corpus cut into a heavy-tailed mix of documents (log-uniform lengths
in [8, 2048], median ~130 tokens). Three ways through ``Trainer``: HF's default path
(``DataCollatorForLanguageModeling``, 8 documents padded per step, sdpa with a padding mask), packed eager
(``PackgraphTrainer(graphs=False)``, T=4096) and packed graphed (``PackgraphTrainer``). The reference for graphed
is packed eager, the same Trainer with the same seed and data: under deterministic kernels the two replay the same
kernels, so their losses agree to the last bits.
"""

import os

# cuBLAS reads its workspace setting when a handle is created: set it before any test of the session runs a matmul,
# so every handle (the graphs' capture stream included) picks the same deterministic GEMMs.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from packgraph.buckets import default_buckets  # noqa: E402
from packgraph.data.corpus import PAD_ID, VOCAB_SIZE, load_corpus  # noqa: E402
from packgraph.data.stream import split_documents  # noqa: E402
from packgraph.integrations.hf_trainer import (  # noqa: E402
    PackedCollator,
    PackgraphTrainer,
    PackgraphTrainerMixin,
    pack_dataset,
)
from packgraph.train import deterministic_kernels  # noqa: E402

T = 4096
POLICY = default_buckets(T)
STEPS = 50
TIMED_STEPS, WARM_STEPS = 30, 8
PADDED_BATCH = 8
LOSS_TOL = 1e-4  # relative, per step: bf16 training turns any kernel difference into a visible drift by step 50


def _llama(attn="packgraph"):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=T,
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).cuda()


@pytest.fixture(scope="module")
def examples():
    docs = split_documents(load_corpus(max_docs=400), 2048, min_len=8, seed=0)
    return [{"input_ids": d.tolist()} for d in docs[:4000]]


class _Counting(PackedCollator):
    """Counts each batch's document tokens on the host (no device sync in the timed loop)."""

    def __call__(self, features):
        out = super().__call__(features)
        self.real_tokens.append(int(out["cu_seq_lens_q"][-1]))
        return out


class _Clock(transformers.TrainerCallback):
    """Wall time from the end of step ``warm`` to the end of the run (one sync at each end)."""

    def __init__(self, warm):
        self.warm, self.t0, self.t1 = warm, None, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in (self.warm, state.max_steps):
            torch.cuda.synchronize()
            if state.global_step == self.warm:
                self.t0 = time.perf_counter()
            else:
                self.t1 = time.perf_counter()


def _args(tmp_path, steps, **overrides):
    kw = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=1,
        max_steps=steps,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        bf16=True,
        logging_steps=steps,  # one log (one host read of the loss) at the end
        logging_nan_inf_filter=False,  # it reads the loss on the host every step
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    kw.update(overrides)
    return transformers.TrainingArguments(**kw)


class _Recording(PackgraphTrainer):
    def training_step(self, model, inputs, *args, **kwargs):
        loss = super().training_step(model, inputs, *args, **kwargs)
        self.micro_losses.append(loss)  # a device tensor: read once, after the run
        return loss


def _packed_run(tmp_path, rows, steps, *, graphs, warm=None):
    collator = _Counting(T, buckets=POLICY, pad_token_id=PAD_ID)
    collator.real_tokens = []
    clock = _Clock(warm) if warm is not None else None
    trainer = _Recording(
        model=_llama(),
        args=_args(tmp_path, steps),
        train_dataset=rows,
        data_collator=collator,
        graphs=graphs,
        callbacks=[clock] if clock is not None else None,
    )
    trainer.micro_losses = []
    trainer.train()
    losses = torch.stack(trainer.micro_losses).float().cpu()
    tps = None
    if clock is not None:
        tps = sum(collator.real_tokens[warm:steps]) / (clock.t1 - clock.t0)
    return trainer, losses, tps


def test_trainer_graphed_equals_packed_eager_under_deterministic_kernels(tmp_path, examples, report):
    rows = pack_dataset(examples, T)
    assert len(rows) >= STEPS
    with deterministic_kernels(True):
        _, eager, _ = _packed_run(tmp_path / "eager", rows, STEPS, graphs=False)
        graphed_trainer, graphed, _ = _packed_run(tmp_path / "graphed", rows, STEPS, graphs=True)
    layers = graphed_trainer.packgraph_layers
    assert layers is not None and all("forward" in t.__dict__ for t in layers.targets)
    rel = ((graphed - eager).abs() / eager.abs()).max().item()
    report(f"hf Trainer graphed vs packed eager, deterministic: max rel loss diff ({STEPS} steps)", f"{rel:.2e}")
    report(
        "hf Trainer graphed vs packed eager, deterministic: bitwise-equal steps",
        f"{int((graphed == eager).sum())}/{STEPS}",
    )
    report("hf Trainer graphed: graphs per layer (buckets met)", layers.graphed[0].num_graphs)
    report("hf Trainer final loss: packed eager / graphed", f"{eager[-1]:.4f} / {graphed[-1]:.4f}")
    assert rel <= LOSS_TOL
    assert eager[-1] < eager[0]  # it trains


def test_trainer_tokens_per_second_padded_vs_packed_vs_graphed(tmp_path, examples, report):
    """Real (document) tokens per second of steady Trainer steps, the three ways, in one run."""
    padded_counts = []
    lm_collator = transformers.DataCollatorForLanguageModeling(tokenizer=_tokenizer(), mlm=False)

    def padded_collator(features):
        out = lm_collator(features)
        padded_counts.append(int(out["attention_mask"].sum()))
        return out

    clock = _Clock(WARM_STEPS)
    padded = transformers.Trainer(
        model=_llama("sdpa"),
        args=_args(tmp_path / "padded", TIMED_STEPS, per_device_train_batch_size=PADDED_BATCH),
        train_dataset=examples,
        data_collator=padded_collator,
        callbacks=[clock],
    )
    padded.train()
    padded_tps = sum(padded_counts[WARM_STEPS:TIMED_STEPS]) / (clock.t1 - clock.t0)
    rows = pack_dataset(examples, T)
    _, eager_losses, eager_tps = _packed_run(tmp_path / "eager", rows, TIMED_STEPS, graphs=False, warm=WARM_STEPS)
    _, graphed_losses, graphed_tps = _packed_run(tmp_path / "graphed", rows, TIMED_STEPS, graphs=True, warm=WARM_STEPS)
    report(f"hf Trainer padded (sdpa + mask, {PADDED_BATCH} docs/step): real tokens/s", f"{padded_tps:.0f}")
    report(f"hf Trainer packed eager (T={T}): real tokens/s", f"{eager_tps:.0f}")
    report(f"hf Trainer packed graphed (T={T}): real tokens/s", f"{graphed_tps:.0f}")
    report("hf Trainer graphed speedup vs packed eager", f"{graphed_tps / eager_tps:.2f}", "x")
    report("hf Trainer graphed speedup vs padded", f"{graphed_tps / padded_tps:.2f}", "x")
    padded_loss = padded.state.log_history[-1]["train_loss"]
    report(
        "hf Trainer final loss: padded / packed eager / graphed",
        f"{padded_loss:.4f} / {eager_losses[-1]:.4f} / {graphed_losses[-1]:.4f}",
    )
    rel = ((graphed_losses - eager_losses).abs() / eager_losses.abs()).max().item()
    assert rel <= 2e-2  # default (non-deterministic) kernels: the run-to-run noise of FA2's backward only
    assert graphed_tps > eager_tps > padded_tps


def _tokenizer():
    """A word-level tokenizer over the corpus's byte vocabulary (``t0``..``t257``), built offline."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"t{i}": i for i in range(VOCAB_SIZE)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=f"t{PAD_ID}"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=f"t{PAD_ID}", eos_token="t256", unk_token=f"t{PAD_ID}"
    )


def test_trl_sft_trainer_packing_graphed_equals_eager(tmp_path, examples, report):
    """TRL's SFTTrainer(packing=True): its best-fit packed rows, re-collated at fixed shape, graphed vs eager.

    Under deterministic kernels, as the Trainer test above: with FA2's atomic ``dq`` accumulation, 30 bf16 steps at
    lr 1e-3 turn run-to-run noise into loss differences of up to a few 1e-2, which would hide a real divergence.
    """
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict({"input_ids": [e["input_ids"] for e in examples[:1500]]})
    trainer_class = type("PackgraphSFTTrainer", (PackgraphTrainerMixin, trl.SFTTrainer), {})
    results = {}
    for graphs in (False, True):
        clock = _Clock(WARM_STEPS)
        config = trl.SFTConfig(
            output_dir=str(tmp_path / str(graphs)), max_steps=TIMED_STEPS, per_device_train_batch_size=1,
            learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
            bf16=True, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
            packing=True, max_length=T, gradient_checkpointing=False, dataloader_num_workers=0,
        )  # fmt: skip
        trainer = trainer_class(
            model=_llama(), args=config, train_dataset=dataset, processing_class=_tokenizer(), total_tokens=T,
            graphs=graphs, callbacks=[clock],
        )  # fmt: skip
        assert isinstance(trainer.data_collator, PackedCollator)
        with deterministic_kernels(True):
            trainer.train()
        losses = torch.tensor([e["loss"] for e in trainer.state.log_history if "loss" in e])
        results[graphs] = (losses, clock.t1 - clock.t0)
    (eager, eager_s), (graphed, graphed_s) = results[False], results[True]
    rel = ((graphed - eager).abs() / eager.abs()).max().item()
    report(f"trl SFTTrainer(packing=True) graphed vs eager, deterministic: max rel loss diff ({TIMED_STEPS} steps)",
           f"{rel:.2e}")  # fmt: skip
    report("trl SFTTrainer(packing=True) graphed vs eager, deterministic: bitwise-equal steps",
           f"{int((graphed == eager).sum())}/{TIMED_STEPS}")  # fmt: skip
    report("trl SFTTrainer(packing=True) step-time speedup, graphed vs eager (deterministic kernels)",
           f"{eager_s / graphed_s:.2f}", "x")  # fmt: skip
    assert len(eager) == len(graphed) == TIMED_STEPS
    assert rel <= LOSS_TOL
    assert eager[-1] < eager[0]  # it trains
