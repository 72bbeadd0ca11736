"""What a training run depends on: :class:`TrainConfig`, the device it names and the default out dir."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from packgraph.buckets import BucketPolicy, default_buckets, document_mask_buckets
from packgraph.data.corpus import VOCAB_SIZE
from packgraph.models.gpt import SCOPES, GPTConfig
from packgraph.packing import PACKING_ALGORITHMS

__all__ = ["TrainConfig", "resolve_device", "default_out_dir"]


ATTENTION_BACKENDS = ("flash", "doc_mask", "auto")
"""The model's attention: ``varlen_attention``'s two backends, or the faster on the device (``"auto"``)."""

DP_ENGINES = ("ddp", "allreduce")
"""Who sums the gradients over the ranks of a ``torchrun`` job (:mod:`packgraph.train.parallel`)."""


@dataclass
class TrainConfig:
    """Everything a run depends on. ``validate()`` rejects bad values with a ``ValueError`` that says what to do.

    ``T`` is the rows per micro-batch (static: every batch has exactly ``T`` rows). ``graphs=None`` means "on
    when the device is CUDA". Bucket ladders default to :func:`~packgraph.buckets.default_buckets` of ``T``.
    ``attention_backend`` is the model's: ``"flash"``, ``"doc_mask"`` (one bucket,
    :func:`~packgraph.buckets.document_mask_buckets`) or ``"auto"``, which :meth:`resolved` turns into the faster
    of the two on the run's device (:func:`~packgraph.backend_choice.choose_attention_backend`).
    ``log_every`` is how often the loop reads its values from the device (see :mod:`packgraph.train`); every
    step is still logged, with its own loss.
    """

    preset: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    steps: int = 100
    T: int = 2048
    grad_accum: int = 1
    dp_engine: str = "ddp"
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "auto"
    autocast: bool = True
    graphs: bool | None = False
    scope: str = "layer"
    attention_backend: str = "flash"
    max_seqlen_ladder: tuple[int, ...] | None = None
    capacity_ladder: tuple[int, ...] | None = None
    max_docs: int | None = None
    chunk_len: int | None = None
    min_chunk_len: int | None = 64
    pad_to_multiple: int = 1
    algorithm: str = "ffd"
    out_dir: str | None = None
    resume: str | None = None
    checkpoint_every: int = 0
    save_checkpoint: bool = True
    progress: bool = True
    plot: bool = True
    deterministic: bool = False
    log_every: int = 1

    def validate(self) -> TrainConfig:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        GPTConfig.preset(self.preset, vocab_size=VOCAB_SIZE, **self.model_overrides)  # raises on a bad preset
        need(self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        need(self.T >= 2, f"T (rows per micro-batch) must be >= 2, got {self.T}")
        need(self.grad_accum >= 1, f"grad_accum must be >= 1, got {self.grad_accum}")
        # nan and inf fail these comparisons or pass them: isfinite rules both out (an inf lr trains to NaN losses).
        need(
            math.isfinite(self.lr) and self.lr > 0,
            f"lr (--lr) must be a finite number > 0, got {self.lr}; pass a learning rate such as 1e-3",
        )
        need(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        need(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        need(self.grad_clip >= 0, f"grad_clip must be >= 0 (0 disables), got {self.grad_clip}")
        need(self.scope in SCOPES, f"scope must be one of {SCOPES}, got {self.scope!r}")
        need(self.dp_engine in DP_ENGINES, f"dp_engine must be one of {DP_ENGINES}, got {self.dp_engine!r}")
        need(self.max_docs is None or self.max_docs >= 1, f"max_docs must be >= 1, got {self.max_docs}")
        need(self.chunk_len is None or self.chunk_len >= 2, f"chunk_len must be >= 2, got {self.chunk_len}")
        need(
            self.min_chunk_len is None or self.min_chunk_len >= 2,
            f"min_chunk_len must be >= 2, got {self.min_chunk_len}",
        )
        # Without chunk_len the longest piece is the largest max_seqlen rung, and the data stream clamps
        # min_chunk_len to it; a chunk_len below min_chunk_len is a contradiction, reported rather than clamped.
        need(
            self.chunk_len is None or self.min_chunk_len is None or self.min_chunk_len <= self.chunk_len,
            f"min_chunk_len (--min-chunk-len, default {_DEFAULT_MIN_CHUNK_LEN}) is {self.min_chunk_len} but chunk_len "
            f"(--chunk-len) is {self.chunk_len}: documents are cut into pieces of min_chunk_len to chunk_len tokens; "
            f"pass --min-chunk-len <= {self.chunk_len} or --chunk-len >= {self.min_chunk_len}",
        )
        need(self.pad_to_multiple >= 1, f"pad_to_multiple must be >= 1, got {self.pad_to_multiple}")
        need(self.algorithm in PACKING_ALGORITHMS, f"algorithm must be one of {PACKING_ALGORITHMS}")
        need(self.checkpoint_every >= 0, f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        need(self.log_every >= 1, f"log_every must be >= 1, got {self.log_every}")
        need(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        need(
            self.attention_backend == "flash" or (self.max_seqlen_ladder is None and self.capacity_ladder is None),
            f"bucket ladders are FlashAttention's: attention_backend {self.attention_backend!r} runs "
            "document_mask_buckets(T) (one bucket) when it runs the document mask; drop --max-seqlen-ladder and "
            "--capacity-ladder, or use --attention-backend flash",
        )
        if self.attention_backend != "auto":
            self.bucket_policy()  # raises on bad ladders
        return self

    def resolved(self, device: torch.device, echo: Callable[[str], None] | None = None) -> TrainConfig:
        """This config with ``attention_backend="auto"`` replaced by the backend measured faster on ``device`` for
        its model's attention shape (itself otherwise). ``echo`` gets a line with the measured times.

        Raises:
            ValueError: ``"doc_mask"`` on a CPU device (torch's FlexAttention has no backward there).
        """
        if self.attention_backend == "doc_mask" and device.type == "cpu":
            raise ValueError(
                "attention_backend 'doc_mask' cannot train on the CPU (torch's FlexAttention has no backward there); "
                "use --attention-backend flash (or auto, which picks flash on the CPU)"
            )
        if self.attention_backend != "auto":
            return self
        from packgraph.backend_choice import choose_attention_backend

        model = self._model_config("flash")
        choice = choose_attention_backend(
            self.T,
            model.n_head,
            model.n_kv_head,
            model.head_dim,
            device=device,
            dtype=torch.bfloat16 if self.autocast else torch.float32,
        )
        if echo is not None:
            measured = ", ".join(f"{name} {ms:.3f} ms" for name, ms in choice.times_ms.items()) or choice.reason
            echo(f"attention backend: {choice.backend} (auto: {measured})")
        return dataclasses.replace(self, attention_backend=choice.backend)

    def bucket_policy(self) -> BucketPolicy:
        """The policy batches are bucketed with (``ValueError`` on bad ladders, or an unresolved ``"auto"``)."""
        self._need_resolved()
        if self.attention_backend == "doc_mask":
            return document_mask_buckets(self.T)
        default = default_buckets(self.T)
        policy = BucketPolicy(
            tuple(self.max_seqlen_ladder or default.max_seqlen_ladder),
            tuple(self.capacity_ladder or default.capacity_ladder),
        )
        if policy.max_seqlen > self.T:
            raise ValueError(f"max_seqlen ladder {policy.max_seqlen_ladder} has rungs above T={self.T}")
        return policy

    def model_config(self) -> GPTConfig:
        self._need_resolved()
        return self._model_config(self.attention_backend)

    def _model_config(self, attention_backend: str) -> GPTConfig:
        overrides = {"attention_backend": attention_backend, **self.model_overrides}
        return GPTConfig.preset(self.preset, vocab_size=VOCAB_SIZE, **overrides)

    def _need_resolved(self) -> None:
        if self.attention_backend == "auto":
            raise ValueError("attention_backend 'auto' is chosen on the run's device: use TrainConfig.resolved(device)")


_DEFAULT_MIN_CHUNK_LEN = TrainConfig.__dataclass_fields__["min_chunk_len"].default


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> cuda when available, else cpu. ``ValueError`` for CUDA without CUDA or an unknown name."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"unknown device {name!r} (use auto, cpu, cuda or cuda:N)") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available here; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r} (use cpu or cuda)")
    return device


def default_out_dir(command: str) -> Path:
    """``./runs/<command>-<timestamp>``, made unique with a suffix when it already exists."""
    base = Path("runs") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = base, 1
    while out.exists():
        out, n = base.with_name(f"{base.name}-{n}"), n + 1
    return out
