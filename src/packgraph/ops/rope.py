"""Rotary position embedding over a packed (THD) token stream, graph-safe.

Positions restart at each sequence's layout start (``cu_seqlens_q_padded`` when present, else
``cu_seqlens_q``) and are computed on the device with a fixed shape: no host sync, so a captured graph stays
valid when the offsets change. Rows past a sequence's real length (padding) and past the last offset (tail)
keep counting from their slot's start; they are dead rows that attention zeroes, so their value is immaterial.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from packgraph.ops.attention import row_layout
from packgraph.params import PackedSeqParams

__all__ = ["apply_rope_thd", "rope_positions"]

_inv_freq_cache: dict[tuple[int, float, torch.device, torch.dtype], Tensor] = {}


def rope_positions(packed_seq_params: PackedSeqParams, total_tokens: int) -> Tensor:
    """Position of each row within its sequence: int64 ``[total_tokens]``, on the params' device.

    ``pos[r] = r - layout[s]`` for the slot ``s`` whose layout range holds row ``r`` (the tail counts from the
    last offset). Built with ``searchsorted`` on the device; no sync.
    """
    return row_layout(packed_seq_params, "q", total_tokens).pos


@torch.compiler.assume_constant_result
def _inv_freq(head_dim: int, base: float, device: torch.device, dtype: torch.dtype) -> Tensor:
    # Under torch.compile, Dynamo runs this at trace time and bakes the tensor into the graph as a constant: the
    # kernels load it, as they load the eager cache's tensor. Traced instead, the cache's inference-mode query
    # breaks the graph; computed in the graph, Inductor inlines pow into the rotation of every element.
    key = (head_dim, float(base), device, dtype)
    cached = _inv_freq_cache.get(key)
    if cached is not None:
        return cached
    inv_freq = _computed_inv_freq(head_dim, base, device, dtype)
    # A tensor made during capture lives in the graph's pool and only holds values once the graph replays;
    # an inference tensor cannot join autograd later. Cache neither.
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not capturing and not torch.is_inference_mode_enabled():
        _inv_freq_cache[key] = inv_freq
    return inv_freq


def _computed_inv_freq(head_dim: int, base: float, device: torch.device, dtype: torch.dtype) -> Tensor:
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim
    return 1.0 / (float(base) ** exponents)


def apply_rope_thd(
    x: Tensor,
    packed_seq_params: PackedSeqParams,
    *,
    base: float = 10000.0,
    position_ids: Tensor | None = None,
) -> Tensor:
    """Rotate ``x`` ``[T, H, D]`` (``D`` even) by its rows' positions, rotate-half (Llama / GPT-NeoX) convention.

    ``out = x * cos(p * f) + rotate_half(x) * sin(p * f)`` with ``f = cat(inv_freq, inv_freq)``,
    ``inv_freq[i] = base ** (-2i / D)`` and ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``.

    Args:
        x: ``[T, H, D]``, a floating-point dtype; the result has x's dtype and shape.
        packed_seq_params: gives positions that restart at each sequence start (see :func:`rope_positions`).
        base: RoPE base (static), finite and > 0.
        position_ids: optional integer ``[T]`` (or ``[1, T]``) positions on x's device that override the params'
            ones, e.g. global positions under context parallelism.

    Raises:
        ValueError: naming the argument: ``x`` not ``[T, H, D]`` floating point or ``D`` odd, ``base`` not finite
            and positive, ``position_ids`` not an integer ``[T]``/``[1, T]`` tensor on x's device.

    Angles and the rotation are computed in float32 (float64 for float64 input) and cast back. Differentiable,
    graph-safe (no host sync).
    """
    if x.dim() != 3:
        raise ValueError(f"apply_rope_thd: x must be [tokens, heads, head_dim], got {tuple(x.shape)}")
    if not x.is_floating_point():
        # The rotation is cast back to x's dtype: an integer x would come back rounded.
        raise ValueError(f"apply_rope_thd: x must be floating point, got {x.dtype}; cast it (x.float()) first")
    t, _, d = x.shape
    if d % 2:
        raise ValueError(f"apply_rope_thd: head_dim must be even, got {d}")
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not (math.isfinite(base) and base > 0):
        # base ** (-2i / D): a base of 0 gives inf frequencies and NaN rotations.
        raise ValueError(f"apply_rope_thd: base must be a finite number > 0, got {base!r} (RoPE uses 10000.0)")
    if position_ids is None:
        if packed_seq_params.cu_seqlens_q.device != x.device:
            raise ValueError(f"apply_rope_thd: params on {packed_seq_params.cu_seqlens_q.device}, x on {x.device}")
        positions = rope_positions(packed_seq_params, t)
    else:
        if tuple(position_ids.shape) not in ((t,), (1, t)):
            raise ValueError(
                f"apply_rope_thd: position_ids must be [{t}] or [1, {t}] (one per row of x), got "
                f"{tuple(position_ids.shape)}"
            )
        if position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool:
            raise ValueError(
                f"apply_rope_thd: position_ids must be an integer tensor, got {position_ids.dtype}; pass .long()"
            )
        if position_ids.device != x.device:
            raise ValueError(f"apply_rope_thd: position_ids on {position_ids.device}, x on {x.device}")
        positions = position_ids.reshape(t)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    angles = positions.to(compute)[:, None] * _inv_freq(d, base, x.device, compute)[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]  # [T, 1, D]
    xf = x.to(compute)
    first, second = xf.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (xf * angles.cos() + rotated * angles.sin()).to(x.dtype)
