"""Train a Megatron-Core GPTModel on packed THD batches of the embedded corpus, eagerly and under packgraph graphs.

The model is Megatron's own ``GPTModel`` (RoPE, grouped-query attention) built with
``packgraph.integrations.megatron.get_gpt_layer_packgraph_spec()``: Megatron's local layers with packgraph's
varlen attention and graph-safe THD RoPE. Batches are the stdlib corpus packed into ``T``-row bins, their static
``max_seqlen``/capacity from ``packgraph.default_buckets(T)``, and reach the model as Megatron's ``PackedSeqParams``.
Each run starts from the same weights and sees the same batches: one eager run, then one per graph scope with
``graph_transformer_layers(model, sample, scope=..., buckets=...)``. It prints the largest loss difference
between each graphed run and the eager one, and the median step-time speedup, and writes ``results.json`` and
``losses.png`` (the loss curves) under ``--out-dir``.

    python examples/megatron_packed_gpt.py                                   # 60 steps, scope layer
    python examples/megatron_packed_gpt.py --steps 300 --deterministic --scopes layer attn --out-dir runs/mgpt
    torchrun --nproc_per_node 8 examples/megatron_packed_gpt.py --ddp   # Megatron's DDP, each rank its batches

``--deterministic`` makes every kernel deterministic (FlashAttention's backward without atomics): eager and
graphed runs then give bitwise-equal losses. Needs CUDA and megatron-core; parameters are bf16 (Megatron's usual
compute dtype), AdamW steps them directly. With ``--ddp`` under torchrun every run trains inside Megatron's
``DistributedDataParallel`` (overlapped, bucketed all-reduce into its ``main_grad`` buffers): each rank takes its
share of each step's batches, and the loss is normalised by the step's global target count, so the summed grads are
those of one process on the union. ``run(ExampleConfig(...))`` is the same from Python (the GPU tests call
it); on the CPU it runs eagerly only, for tests that set Megatron up for the CPU themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from packgraph import default_buckets
from packgraph.data.corpus import VOCAB_SIZE, load_corpus
from packgraph.data.stream import DataStream, split_documents
from packgraph.distributed import global_token_count, shard_batches
from packgraph.graphs import loop_stream
from packgraph.integrations.megatron import get_gpt_layer_packgraph_spec, graph_transformer_layers, to_megatron
from packgraph.packing import PackedBatch
from packgraph.train import deterministic_kernels
from packgraph.train.logs import plot_losses


@dataclasses.dataclass
class ExampleConfig:
    """One comparison: the model, the data and the runs (``scopes`` are graphed; the eager run always comes first)."""

    steps: int = 60
    T: int = 2048
    d_model: int = 256
    layers: int = 4
    heads: int = 8
    query_groups: int = 4
    lr: float = 1e-3
    seed: int = 0
    scopes: tuple[str, ...] = ("layer",)
    deterministic: bool = False
    max_docs: int = 400
    min_chunk_len: int = 16
    timing_skip: int = 5  # first steps (captures, allocator warm-up) left out of the median step time
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    dtype: torch.dtype = torch.bfloat16
    ddp: bool = False  # Megatron's DistributedDataParallel over the job's ranks (each its share of every step)


# ---------------------------------------------------------------------------------------------------- Megatron setup
@contextlib.contextmanager
def megatron_parallel_state(seed: int, *, cudagraphable_rng: bool = False) -> Iterator[None]:
    """One process, model-parallel sizes 1: a one-rank process group (NCCL on CUDA) and Megatron's parallel state,
    seeded. Reuses a process group or parallel state that already exists (and leaves it in place)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    started_group = not torch.distributed.is_initialized()
    if started_group:
        # torchrun's environment when it launched us, else a group of one
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend, rank=rank, world_size=world)
    started_state = not parallel_state.model_parallel_is_initialized()
    if started_state:
        parallel_state.initialize_model_parallel(1, 1)
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cudagraphable_rng, force_reset_rng=True)
    try:
        yield
    finally:
        if started_state:
            parallel_state.destroy_model_parallel()
        if started_group:
            torch.distributed.destroy_process_group()


def megatron_config(cfg: ExampleConfig, **overrides: Any) -> Any:
    """The TransformerConfig of ``cfg``: no dropout (the varlen kernel has no attention dropout), bf16 parameters.

    ``bias_dropout_fusion`` is off: Megatron would ``torch.compile`` the fused op at its first call, a long pause in
    a short demo.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = cfg.dtype == torch.bfloat16
    fields = dict(
        num_layers=cfg.layers,
        hidden_size=cfg.d_model,
        ffn_hidden_size=4 * cfg.d_model,
        num_attention_heads=cfg.heads,
        num_query_groups=cfg.query_groups,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        # The loss is divided by the global target count: Megatron's DDP must sum the ranks' grads, not average
        calculate_per_token_loss=cfg.ddp,
        bf16=bf16,
        params_dtype=cfg.dtype,
        use_cpu_initialization=cfg.device == "cpu",
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_model(cfg: ExampleConfig, config: Any = None) -> torch.nn.Module:
    """Megatron's GPTModel with the packgraph layer spec, RoPE, on ``cfg.device``, every parameter in ``cfg.dtype``
    (what Megatron's ``Float16Module`` does: its norms are built in float32)."""
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(cfg.seed)
    model = GPTModel(
        config if config is not None else megatron_config(cfg),
        get_gpt_layer_packgraph_spec(),
        vocab_size=VOCAB_SIZE,
        max_sequence_length=cfg.T,
        position_embedding_type="rope",
    )
    return model.to(device=cfg.device, dtype=cfg.dtype)


def make_batches(cfg: ExampleConfig, count: int | None = None) -> list[PackedBatch]:
    """``count`` (default ``cfg.steps``) packed batches of the corpus, in the data stream's seeded order; with
    ``cfg.ddp``, this rank's share of ``count * world`` of them (batch ``s * world + rank`` at step ``s``)."""
    policy = default_buckets(cfg.T)
    docs = split_documents(
        load_corpus(max_docs=cfg.max_docs), policy.max_seqlen, min_len=cfg.min_chunk_len, seed=cfg.seed
    )
    stream = DataStream(docs, T=cfg.T, policy=policy, seed=cfg.seed)
    count = cfg.steps if count is None else count
    if not cfg.ddp:
        return [next(stream) for _ in range(count)]
    world = torch.distributed.get_world_size()
    return list(shard_batches((next(stream) for _ in range(count * world)), torch.distributed.get_rank(), world))


# ---------------------------------------------------------------------------------------------------- one run
def packed_loss(
    model: torch.nn.Module, batch: PackedBatch, params: Any, count: torch.Tensor | None = None
) -> torch.Tensor:
    """Next-token cross entropy summed over the rows with a target, divided by ``count`` (default: the batch's
    own target count, a mean). No host read: the count stays on the device."""
    logits = model(batch.tokens[None], batch.position_ids[None], None, packed_seq_params=params)[0]
    per_row = torch.nn.functional.cross_entropy(logits.float(), batch.labels.clamp_min(0), reduction="none")
    return (per_row * batch.loss_mask).sum() / (batch.loss_mask.sum().clamp_min(1.0) if count is None else count)


def _megatron_ddp(model: torch.nn.Module) -> torch.nn.Module:
    """Megatron's DistributedDataParallel over every rank, its all-reduce overlapped with the backward in buckets.

    The grads reach its ``main_grad`` buffers through the hooks on each parameter's ``AccumulateGrad``, which a
    graphed layer's backward fires as an eager one does. They stay in the parameters' dtype so that AdamW can step
    on them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=False)
    return DistributedDataParallel(model.config, ddp_config, model)


class _StepClock:
    """Step times: CUDA events (read once at the end, no sync per step) or, on the CPU, the wall clock."""

    def __init__(self, device: str) -> None:
        self.cuda = device != "cpu"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def step_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]


def train_run(
    cfg: ExampleConfig,
    initial_state: dict[str, torch.Tensor],
    batches: Sequence[PackedBatch],
    *,
    scope: str | None = None,
) -> dict[str, Any]:
    """Train from ``initial_state`` on ``batches`` (already on the device), eagerly (``scope=None``) or with
    ``graph_transformer_layers(scope=scope)``. Returns losses, step times, graphs captured and peak memory."""
    model = build_model(cfg)
    model.load_state_dict(initial_state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, foreach=True)
    step_module = _megatron_ddp(model) if cfg.ddp else model
    params = [to_megatron(b.packed_seq_params.attention_view()) for b in batches]
    if cfg.device != "cpu":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    clock, losses = _StepClock(cfg.device), []
    clock.mark()
    handle = None
    if scope is not None:
        policy = default_buckets(cfg.T)
        sample = batches[0].packed_seq_params
        handle = graph_transformer_layers(model, sample, scope=scope, buckets=policy, max_graphs=policy.num_buckets)
    for batch, p in zip(batches, params, strict=True):
        optimizer.zero_grad(set_to_none=True)
        if not cfg.ddp:
            loss = packed_loss(model, batch, p)
            loss.backward()
        else:
            step_module.zero_grad_buffer()
            count = global_token_count(batch.num_real_tokens, device=batch.tokens.device)
            loss = packed_loss(step_module, batch, p, count)
            loss.backward()  # DDP's hooks launch the bucket all-reduces as the grads arrive
            step_module.finish_grad_sync()
            for param in model.parameters():
                param.grad = param.main_grad
            loss = loss.detach()
            torch.distributed.all_reduce(loss)  # the step's loss over every rank's targets
        optimizer.step()
        losses.append(loss.detach())
        clock.mark()
    step_ms = clock.step_ms()
    result = {
        "losses": torch.stack(losses).float().tolist(),  # one host read for the whole run
        "first_step_ms": step_ms[0],
        "step_ms": step_ms,
        "median_step_ms": statistics.median(step_ms[cfg.timing_skip :] or step_ms),
        "graphs_captured": handle.captures if handle is not None else 0,
        "signatures": handle.num_signatures if handle is not None else 0,
        "peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20 if cfg.device != "cpu" else None,
    }
    if handle is not None:
        handle.remove()
    return result


# ---------------------------------------------------------------------------------------------------- comparison
def run(cfg: ExampleConfig, out_dir: str | os.PathLike | None = None, echo: Callable[[str], None] | None = print):
    """Eager run, then one graphed run per scope, same weights and batches; summary dict (and files in out_dir).

    The summary holds per run its losses and step times, and per graphed run ``max_abs_loss_diff`` (vs eager),
    ``bitwise_equal`` (losses), ``speedup`` (median eager step / median graphed step) and ``peak_memory_ratio``.
    """
    say = echo or (lambda _: None)
    if cfg.device == "cpu" and cfg.scopes:
        raise RuntimeError("graphed runs need CUDA; pass scopes=() to train eagerly on the CPU")
    batches = [b.to(cfg.device) for b in make_batches(cfg)]
    initial_state = {k: v.detach().clone() for k, v in build_model(cfg).state_dict().items() if v is not None}
    runs: dict[str, dict[str, Any]] = {}
    # One non-default stream for every run: chained layer graphs replay only on the stream they were recorded on,
    # and CUDA cannot record on the default one (docs/streams.md).
    with deterministic_kernels(cfg.deterministic), loop_stream(cfg.device):
        for scope in (None, *cfg.scopes):
            name = "eager" if scope is None else f"graphed-{scope}"
            runs[name] = train_run(cfg, initial_state, batches, scope=scope)
            say(_run_line(name, runs[name]))
            _release_memory(cfg.device)  # each run's peak memory starts from the same baseline
    summary = _summarize(cfg, runs)
    for name, row in summary["graphed"].items():
        say(
            f"{name}: max |loss diff| vs eager {row['max_abs_loss_diff']:.3e} (bitwise equal: {row['bitwise_equal']}), "
            f"median step speedup {row['speedup']:.2f}x, {row['graphs_captured']} graphs"
        )
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(summary, indent=1))
        curves = {name: list(enumerate(r["losses"], start=1)) for name, r in runs.items()}
        plot_losses(curves, out / "losses.png", echo=echo)
        say(f"wrote {out / 'results.json'} and {out / 'losses.png'}")
    return summary


def _release_memory(device: str) -> None:
    gc.collect()  # graphs and their pools sit in reference cycles until a collection
    if device != "cpu":
        torch.cuda.empty_cache()


def _run_line(name: str, r: dict[str, Any]) -> str:
    memory = "" if r["peak_allocated_mib"] is None else f", peak {r['peak_allocated_mib']:.0f} MiB"
    return (
        f"{name}: loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, median step {r['median_step_ms']:.2f} ms, "
        f"first step {r['first_step_ms']:.0f} ms{memory}"
    )


def _summarize(cfg: ExampleConfig, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    eager = runs["eager"]
    graphed = {}
    for name, r in runs.items():
        if name == "eager":
            continue
        diffs = [abs(a - b) for a, b in zip(r["losses"], eager["losses"], strict=True)]
        memory = None
        if eager["peak_allocated_mib"]:
            memory = r["peak_allocated_mib"] / eager["peak_allocated_mib"]
        graphed[name] = {
            "max_abs_loss_diff": max(diffs),
            "bitwise_equal": r["losses"] == eager["losses"],
            "speedup": eager["median_step_ms"] / r["median_step_ms"],
            "graphs_captured": r["graphs_captured"],
            "signatures": r["signatures"],
            "peak_memory_ratio": memory,
        }
    return {
        "config": _jsonable(dataclasses.asdict(cfg)),
        "environment": _environment(),
        "runs": runs,
        "graphed": graphed,
    }


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, torch.dtype) else list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def _environment() -> dict[str, Any]:
    import megatron.core

    env = {"torch": torch.__version__, "megatron_core": megatron.core.__version__}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    defaults = ExampleConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--T", type=int, default=defaults.T, help="rows per packed batch")
    p.add_argument("--d-model", type=int, default=defaults.d_model)
    p.add_argument("--layers", type=int, default=defaults.layers)
    p.add_argument("--heads", type=int, default=defaults.heads)
    p.add_argument("--query-groups", type=int, default=defaults.query_groups)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--scopes", nargs="*", default=list(defaults.scopes), choices=["layer", "attn", "mlp"])
    p.add_argument("--deterministic", action="store_true", help="deterministic kernels (bitwise-equal runs)")
    p.add_argument("--out-dir", default=None, help="write results.json and losses.png here")
    p.add_argument("--ddp", action="store_true", help="under torchrun: Megatron's DDP, each rank its batches")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this example needs a CUDA device (Megatron-Core and CUDA graphs)")
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS handle
    cfg = ExampleConfig(
        steps=args.steps,
        T=args.T,
        d_model=args.d_model,
        layers=args.layers,
        heads=args.heads,
        query_groups=args.query_groups,
        lr=args.lr,
        seed=args.seed,
        scopes=tuple(args.scopes),
        deterministic=args.deterministic,
        ddp=args.ddp,
    )
    with megatron_parallel_state(cfg.seed):
        first = torch.distributed.get_rank() == 0  # only rank 0 talks and writes
        return run(cfg, out_dir=args.out_dir if first else None, echo=print if first else None)


if __name__ == "__main__":
    main()
