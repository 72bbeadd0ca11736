"""Train the reference GPT on the embedded corpus, eagerly or with CUDA graphs.

One step: ``grad_accum`` micro-batches of ``T`` rows each, forward + backward (bf16 autocast on CUDA), gradient
clipping, fused AdamW, then the learning-rate schedule (linear warm-up, cosine decay to
``min_lr_ratio * lr``). Micro-batch losses are weighted by their share of the step's real target tokens, so the
step's gradient is that of the mean CE over every target token of the step (see :mod:`packgraph.models.gpt`).

Data order is deterministic (:mod:`packgraph.data.stream`): corpus pieces of seeded random length, packed once,
each epoch visiting the bins in an order shuffled by ``(seed, epoch)``. The data position is ``(epoch, bin
index)``, so a checkpoint resumes on the very next batch.

Host syncs: a step leaves its loss and gradient norm on the device. A *logged* step (the run's first, every
``log_every``-th, the last, and each checkpoint step) reads the values of every step since the last logged one in
one device-to-host transfer; the other steps never wait for the device (on CUDA, batches go up from pinned memory
without blocking, and step times come from CUDA events). :class:`Trainer` runs a config one step at a time,
:func:`train` runs it to the end.

Artefacts, under ``out_dir``: ``config.json``, ``train.jsonl`` (one row per step, written at logged steps),
``checkpoint.pt`` (latest; ``checkpoint-<step>.pt`` every ``checkpoint_every`` steps), ``summary.json`` and
``loss.png`` (needs matplotlib). Checkpoints hold only data and load without running code
(:mod:`packgraph.train.checkpoint`).

Modules: :mod:`~packgraph.train.config` (the config, the device), :mod:`~packgraph.train.trainer` (the loop),
:mod:`~packgraph.train.step` (one step's parts), :mod:`~packgraph.train.checkpoint`,
:mod:`~packgraph.train.parallel` (data parallel under ``torchrun``), :mod:`~packgraph.train.logs` (reading,
smoothing and plotting logs) and :mod:`~packgraph.train.demo` (``packgraph demo``: eager and graphed training
compared).
"""

from packgraph.data.stream import DataStream, corpus_documents
from packgraph.train.checkpoint import load_checkpoint, resolve_checkpoint
from packgraph.train.config import TrainConfig, default_out_dir, resolve_device
from packgraph.train.step import accumulate_gradients, deterministic_kernels, lr_factor
from packgraph.train.trainer import Trainer, TrainResult, compare_eager_graphed, train

__all__ = [
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "train",
    "load_checkpoint",
    "resolve_checkpoint",
    "deterministic_kernels",
    "accumulate_gradients",
    "compare_eager_graphed",
    "lr_factor",
    "resolve_device",
    "default_out_dir",
    # Re-exported from packgraph.data.stream for callers that take the training names from one place.
    "DataStream",
    "corpus_documents",
]
