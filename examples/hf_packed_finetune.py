"""Fine-tune a tiny random-init Hugging Face Llama on packed batches of the embedded corpus.

The data path is the one HF users already have: documents -> ``DataCollatorWithFlattening`` (one flattened stream
per batch) -> ``packgraph.integrations.hf.from_flattening_batch`` (a fixed-shape ``PackedBatch`` whose static
``max_seqlen``/capacity come from a small bucket ladder). The model is loaded with
``attn_implementation="packgraph"`` so its attention runs ``varlen_attention`` on the packed stream.

* CPU: trains eagerly (float32, the exact reference attention) and prints the loss.
* CUDA: trains the same model eagerly and with graphed decoder layers (``graph_decoder_layers``, bf16), from the
  same initial weights on the same batches, and prints both losses and the median step-time speedup.

    python examples/hf_packed_finetune.py                 # small defaults, < 1 min on a laptop CPU
    python examples/hf_packed_finetune.py --steps 100 --tokens 2048 --hidden 512 --layers 8   # on a GPU

No download: the config is built locally and the corpus is the running Python's standard library.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig

from packgraph.buckets import BucketPolicy
from packgraph.data.corpus import VOCAB_SIZE, load_corpus
from packgraph.graphs import loop_stream
from packgraph.integrations.hf import from_flattening_batch, graph_decoder_layers, packed_forward
from packgraph.packing import pack_sequences
from packgraph.train.logs import largest


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    p.add_argument("--tokens", type=int, default=512, help="rows per packed batch (T)")
    p.add_argument("--max-doc-len", type=int, default=256, help="documents are truncated to this many tokens")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-threads", type=int, default=1, help="intra-op threads on the CPU (tiny models: 1 is fastest)")
    return p.parse_args()


def make_batches(args: argparse.Namespace, policy: BucketPolicy) -> list:
    """Corpus -> bins (first-fit decreasing) -> HF collator per bin -> fixed-shape PackedBatch."""
    docs = load_corpus(max_docs=args.steps * args.tokens // 64 + 64, max_doc_len=args.max_doc_len, min_doc_len=8)
    packing = pack_sequences([len(d) for d in docs], args.tokens, max_seqs_per_bin=policy.max_capacity)
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batches = []
    for indices in packing[: args.steps]:
        flat = collator([{"input_ids": docs[i].tolist()} for i in indices])
        batches.append(from_flattening_batch(flat, buckets=policy, total_tokens=args.tokens))
    if len(batches) < args.steps:
        raise SystemExit(f"the corpus filled only {len(batches)} batches; lower --steps or --tokens")
    return batches


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 8 / 3) // 8 * 8,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.tokens,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="packgraph")


def train(model: torch.nn.Module, batches: list, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """One pass over ``batches``; returns per-step losses and step times in ms (CUDA events on the GPU)."""
    device = torch.device(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses, times = [], []
    for batch in batches:
        batch = batch.to(device, non_blocking=True)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        loss = packed_forward(model, batch, compute_loss=True).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            end.record()
            losses.append(loss.detach())
            times.append((start, end))
        else:
            losses.append(loss.item())
            times.append((time.perf_counter() - t0) * 1e3)
    if device.type == "cuda":
        torch.cuda.synchronize()  # one sync at the end: the loop itself never waits on the GPU
        losses = [x.item() for x in losses]
        times = [s.elapsed_time(e) for s, e in times]
    return losses, times


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    # Two rungs per ladder: at most four graph signatures, and attention never sized for more than it needs.
    policy = BucketPolicy((args.max_doc_len // 2, args.max_doc_len), (16, 64))
    batches = make_batches(args, policy)
    model = make_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Llama {n_params / 1e6:.2f}M params, {args.steps} steps of {args.tokens} tokens on {device}")
    print(policy.describe())
    if device.type != "cuda":
        # Ops on a model this small are too short to split across threads: the split only adds synchronization,
        # and on a busy machine spinning threads slow every step down by an order of magnitude.
        torch.set_num_threads(args.cpu_threads)
        model.to(device).train()
        losses, times = train(model, batches, args)
        for i in range(0, len(losses), max(len(losses) // 10, 1)):
            print(f"step {i:4d}  loss {losses[i]:.4f}")
        print(f"final loss {losses[-1]:.4f} (start {losses[0]:.4f}); median step {statistics.median(times):.1f} ms")
        return

    model = model.to(device=device, dtype=torch.bfloat16).train()
    graphed_model = copy.deepcopy(model)
    # Both runs on one non-default stream: the chained layer graphs replay only on the stream they were recorded
    # on, and CUDA cannot record on the default one (docs/streams.md).
    with loop_stream(device):
        eager_losses, eager_times = train(model, batches, args)
        sample = batches[0].to(device)
        handle = graph_decoder_layers(graphed_model, sample, buckets=policy)
        graph_losses, graph_times = train(graphed_model, batches, args)
        handle.remove()
    # The first steps of each run include warm-up (and, graphed, the captures); they are not steady state.
    skip = min(5, len(batches) // 2)
    eager_ms = statistics.median(eager_times[skip:])
    graph_ms = statistics.median(graph_times[skip:])
    for i in range(0, len(batches), max(len(batches) // 10, 1)):
        print(f"step {i:4d}  loss eager {eager_losses[i]:.4f}  graphed {graph_losses[i]:.4f}")
    print(f"final loss eager {eager_losses[-1]:.4f}  graphed {graph_losses[-1]:.4f}")
    diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(eager_losses, graph_losses, strict=True)]
    worst = largest(diffs)[0]  # a NaN counts as the largest (max() keeps whatever precedes one)
    print(f"max relative loss difference, graphed vs eager, over {len(diffs)} steps: {worst:.2e}")
    print(f"median step: eager {eager_ms:.2f} ms, graphed {graph_ms:.2f} ms, speedup {eager_ms / graph_ms:.2f}x")


if __name__ == "__main__":
    main()
