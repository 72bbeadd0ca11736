"""Fine-tune a random-init Llama with ``transformers.Trainer`` three ways, on the same documents, and compare.

1. ``padded``: HF's default path: ``DataCollatorForLanguageModeling`` pads ``--padded-batch`` documents per step,
   sdpa attention with a padding mask.
2. ``packed eager``: ``PackgraphTrainer(graphs=False)``: documents packed ahead of time (``pack_dataset``, best-fit
   decreasing) into fixed-shape rows of ``--tokens`` tokens, ``attn_implementation="packgraph"``.
3. ``packed graphed``: ``PackgraphTrainer``: the same, with the decoder layers replayed from CUDA graphs (CUDA only).

It prints real (document) tokens per second over the steady steps and each run's last logged loss.

    python examples/hf_trainer_packed.py                 # CPU: padded and packed eager, tiny model, < 1 min
    python examples/hf_trainer_packed.py --tokens 4096 --hidden 512 --layers 8 --heads 8 --kv-heads 4 --steps 60

No download: the config and a word-level tokenizer are built locally; the corpus is Python's standard library cut
into a heavy-tailed mix of documents.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import tokenizers
import torch
import transformers

from packgraph.data.corpus import EOS_ID, PAD_ID, VOCAB_SIZE, load_corpus
from packgraph.data.stream import split_documents
from packgraph.integrations.hf_trainer import PackedCollator, PackgraphTrainer, pack_dataset


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    p.add_argument("--warm", type=int, default=5, help="steps left out of the timing (warm-up, graph captures)")
    p.add_argument("--tokens", type=int, default=512, help="rows per packed batch (T)")
    p.add_argument("--padded-batch", type=int, default=8, help="documents per padded step")
    p.add_argument("--min-doc-len", type=int, default=8)
    p.add_argument("--max-doc-len", type=int, default=None, help="longest document (default: T / 2)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--cpu-threads", type=int, default=1, help="intra-op threads on the CPU (tiny models: 1 is fastest)")
    return p.parse_args()


class CountingCollator(PackedCollator):
    """Counts each batch's document tokens on the host, so the timed loop never waits on the device."""

    real_tokens: list[int]

    def __call__(self, features):
        out = super().__call__(features)
        self.real_tokens.append(int(out["cu_seq_lens_q"][-1]))
        return out


class Clock(transformers.TrainerCallback):
    """Wall time from the end of step ``warm`` to the end of the run."""

    def __init__(self, warm: int) -> None:
        self.warm, self.start, self.end = warm, 0.0, 0.0

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in (self.warm, state.max_steps):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            setattr(self, "start" if state.global_step == self.warm else "end", time.perf_counter())


def make_model(args: argparse.Namespace, attn: str) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 8 / 3) // 8 * 8,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.tokens,
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Token ``i`` is the word ``t{i}``: enough for the padding collator, which only pads ids."""
    vocab = {f"t{i}": i for i in range(VOCAB_SIZE)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=f"t{PAD_ID}"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=f"t{PAD_ID}", eos_token=f"t{EOS_ID}", unk_token=f"t{PAD_ID}"
    )


def training_args(args: argparse.Namespace, out_dir: str, batch_size: int) -> transformers.TrainingArguments:
    cuda = torch.cuda.is_available()
    return transformers.TrainingArguments(
        output_dir=out_dir,
        use_cpu=not cuda,
        bf16=cuda,
        per_device_train_batch_size=batch_size,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        logging_steps=max(args.steps // 4, 1),
        logging_nan_inf_filter=False,  # it reads the loss on the host at every step
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )


def run(way: str, args: argparse.Namespace, examples: list[dict], rows) -> tuple[float, float]:
    """One Trainer run; returns (real tokens/s over the steady steps, last logged loss)."""
    clock = Clock(args.warm)
    with tempfile.TemporaryDirectory() as out_dir:
        if way == "padded":
            counts: list[int] = []
            lm_collator = transformers.DataCollatorForLanguageModeling(tokenizer=word_tokenizer(), mlm=False)

            def collator(features):
                batch = lm_collator(features)
                counts.append(int(batch["attention_mask"].sum()))
                return batch

            trainer = transformers.Trainer(
                model=make_model(args, "sdpa"),
                args=training_args(args, out_dir, args.padded_batch),
                train_dataset=examples,
                data_collator=collator,
                callbacks=[clock],
            )
        else:
            collator = CountingCollator(args.tokens, pad_token_id=PAD_ID)
            collator.real_tokens = counts = []
            trainer = PackgraphTrainer(
                model=make_model(args, "packgraph"),
                args=training_args(args, out_dir, 1),
                train_dataset=rows,
                data_collator=collator,
                graphs=way == "packed graphed",
                callbacks=[clock],
            )
        trainer.train()
    loss = [e["loss"] for e in trainer.state.log_history if "loss" in e][-1]
    return sum(counts[args.warm : args.steps]) / (clock.end - clock.start), loss


def main() -> None:
    args = parse_args()
    if args.steps <= args.warm:
        raise SystemExit("--steps must exceed --warm")
    if not torch.cuda.is_available():
        torch.set_num_threads(args.cpu_threads)
    max_doc_len = args.max_doc_len or args.tokens // 2
    docs = split_documents(load_corpus(max_docs=400), max_doc_len, min_len=args.min_doc_len, seed=0)
    examples = [{"input_ids": d.tolist()} for d in docs[: max(args.steps * args.tokens // 64, 64 * args.steps)]]
    rows = pack_dataset(examples, args.tokens)
    print(f"{len(examples)} documents, {rows}; {rows.packing.efficiency:.1%} of each row holds documents")
    if len(rows) < args.steps:
        raise SystemExit(f"only {len(rows)} packed rows; lower --steps or --tokens")
    ways = ["padded", "packed eager"] + (["packed graphed"] if torch.cuda.is_available() else [])
    results = {way: run(way, args, examples, rows) for way in ways}
    base = results["padded"][0]
    print(f"\n{'way':<16}{'real tokens/s':>15}{'vs padded':>11}{'last loss':>11}")
    for way, (tps, loss) in results.items():
        print(f"{way:<16}{tps:>15.0f}{tps / base:>10.2f}x{loss:>11.4f}")
    if "packed graphed" not in results:
        print("(no CUDA here: the graphed run needs a GPU)")


if __name__ == "__main__":
    main()
