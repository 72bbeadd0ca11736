"""Per-token logprobs of packed sequences (the RL scoring path), through forward-only CUDA graphs.

:func:`score` runs every batch eagerly and, when asked, through ``model.graphed(scope, forward_only=True)``,
and reports the largest difference between the two: graphs must not change the numbers an RL loss is built on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from packgraph.models.gpt import GPT
from packgraph.packing import PackedBatch
from packgraph.train.logs import largest

__all__ = ["ScoreResult", "score"]


@dataclass
class ScoreResult:
    """Logprobs and timings of one :func:`score` call.

    Attributes:
        logprobs: per batch, float32 ``[T]`` on the CPU: ``log p(label)`` per row, 0 where there is no target.
            The graphed values when ``graphed``, else the eager ones.
        eager_logprobs: the eager values, same layout.
        max_abs_diff: ``max |graphed - eager|`` over every row of every batch; ``None`` when not graphed.
        eager_ms / graphed_ms: mean wall time per batch on a second (warm) pass; ``graphed_ms`` is ``None`` when
            not graphed. The first graphed pass captures and is not timed.
        target_tokens: rows with a target, over all batches.
        mean_logprob: mean logprob per target token (of ``logprobs``).
    """

    logprobs: list[Tensor]
    eager_logprobs: list[Tensor]
    max_abs_diff: float | None
    eager_ms: float
    graphed_ms: float | None
    target_tokens: int
    mean_logprob: float

    @property
    def speedup(self) -> float | None:
        return None if self.graphed_ms is None else self.eager_ms / self.graphed_ms


def _timed_pass(fn, batches: Sequence[PackedBatch], device: torch.device) -> tuple[list[Tensor], float]:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    t0 = time.perf_counter()
    # .cpu() right away: graph outputs may alias static buffers that the next replay overwrites.
    out = [fn(b).float().cpu() for b in batches]
    sync()
    return out, (time.perf_counter() - t0) * 1e3 / max(len(batches), 1)


def score(
    model: GPT,
    batches: Sequence[PackedBatch],
    graphed: bool = True,
    *,
    scope: str = "layer",
    autocast: bool = True,
) -> ScoreResult:
    """Per-token logprobs of ``batches`` with ``model`` (put in eval mode), eager and optionally graphed.

    Args:
        model: a :class:`GPT` on its target device; batches are moved there.
        batches: fixed-shape packed batches (bucketed batches share graphs per bucket).
        graphed: also run forward-only CUDA graphs (needs CUDA) and compare with eager.
        scope: graph scope (see :meth:`GPT.graphed`).
        autocast: bf16 autocast on CUDA, for both passes.

    Raises:
        RuntimeError: ``graphed`` on a model that is not on CUDA.
    """
    model.eval()
    device = next(model.parameters()).device
    batches = [b.to(device) for b in batches]

    def ctx() -> contextlib.AbstractContextManager:
        if device.type == "cuda" and autocast:
            return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)
        return contextlib.nullcontext()

    with torch.no_grad(), ctx():
        _timed_pass(model.token_logprobs, batches[:1], device)  # warm-up (kernels, allocator)
        eager, eager_ms = _timed_pass(model.token_logprobs, batches, device)
        logprobs, graphed_ms, diff = eager, None, None
        if graphed:
            wrapper = model.graphed(scope=scope, forward_only=True)
            _timed_pass(wrapper.token_logprobs, batches, device)  # captures one graph set per bucket
            logprobs, graphed_ms = _timed_pass(wrapper.token_logprobs, batches, device)
            diff = largest([float((g - e).abs().max()) for g, e in zip(logprobs, eager, strict=True)])[0]
    targets = sum(int((b.labels != -100).sum()) for b in batches)
    total = sum(float(lp.double().sum()) for lp in logprobs)
    return ScoreResult(
        logprobs=logprobs,
        eager_logprobs=eager,
        max_abs_diff=diff,
        eager_ms=eager_ms,
        graphed_ms=graphed_ms,
        target_tokens=targets,
        mean_logprob=total / max(targets, 1),
    )
