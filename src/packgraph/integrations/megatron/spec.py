"""A Megatron-Core layer spec that runs packed THD batches with packgraph's graph-safe attention and RoPE.

:func:`get_gpt_layer_packgraph_spec` is Megatron's own ``get_gpt_layer_local_spec`` (same norms, linears, MLP,
MoE) with two modules swapped:

* the core attention is :class:`PackgraphDotProductAttention`, a ``DotProductAttention`` that runs
  :func:`packgraph.ops.varlen_attention` when it gets THD params (FlashAttention-2 varlen on CUDA for fp16/bf16,
  the exact reference elsewhere; GQA without repeating K/V; padded layouts; rows past the last offset come out as
  exact zeros). Without params (bshd) it *is* Megatron's ``DotProductAttention``;
* the self-attention is :class:`PackgraphSelfAttention`, a ``SelfAttention`` whose THD rotary embedding reads
  each row's position on the device (a ``searchsorted`` over the layout offsets, see
  :func:`packgraph.ops.attention.row_layout`) instead of Megatron's ``_apply_rotary_pos_emb_thd``, which splits
  the stream with ``cu_seqlens.tolist()`` and cannot be captured. No Megatron function is patched: the rotation is
  applied to the query and key that ``get_query_key_value_tensors`` returns, the point where Megatron applies its
  own, with Megatron's formula (``rotary_interleaved``, ``rotary_percent``, the YaRN ``mscale``).

Positions restart at each sequence's layout start (``cu_seqlens_*_padded`` when present), as if each document ran
alone: a packed THD batch gives what each document gives through Megatron's stock bshd path. (Megatron's unfused
THD RoPE switches to positions counted from the stream start when its table happens to be as long as the stream,
its mode for multimodal positions; this spec never does. It refuses mRoPE, whose positions are not per sequence.)

Refused with an error that says what to do: multi-latent attention, ``softmax_type`` other than ``"vanilla"``,
context parallel size > 1, attention dropout in training on THD input, sliding-window attention on THD input, an
attention mask or bias on THD input. Tensor parallelism composes (each rank attends over its own heads) but has
only been run at size 1.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import Tensor

from packgraph.integrations.megatron.convert import from_megatron
from packgraph.ops import varlen_attention
from packgraph.ops.attention import row_layout
from packgraph.params import PackedSeqParams

try:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec
except ImportError as exc:  # pragma: no cover - exercised only without Megatron-Core
    raise ImportError("the packgraph Megatron spec needs Megatron-Core: pip install 'megatron-core>=0.16'") from exc

__all__ = ["PackgraphDotProductAttention", "PackgraphSelfAttention", "get_gpt_layer_packgraph_spec"]

_CAUSAL_MASKS = tuple(
    getattr(AttnMaskType, name) for name in ("causal", "padding_causal") if hasattr(AttnMaskType, name)
)
_NO_MASK = getattr(AttnMaskType, "no_mask", None)


def _as_packgraph(params: Any) -> PackedSeqParams:
    """Packgraph params sharing ``params``' tensors (Megatron's class converted, packgraph's as is)."""
    return params if isinstance(params, PackedSeqParams) else from_megatron(params, validate=False)


def _is_thd(params: Any) -> bool:
    return params is not None and getattr(params, "qkv_format", None) == "thd"


def _refuse_context_parallel(config: Any, where: str) -> None:
    cp = getattr(config, "context_parallel_size", 1) or 1
    if cp > 1:
        raise NotImplementedError(
            f"{where}: context_parallel_size={cp} is not supported by the packgraph spec (its attention sees one "
            "rank's rows only). Run with context_parallel_size=1, or build the attention on "
            "packgraph.distributed.cp_varlen_attention, which gathers K/V across the context-parallel group."
        )


# ---------------------------------------------------------------------------------------------------- attention
class PackgraphDotProductAttention(DotProductAttention):
    """Megatron's ``DotProductAttention`` that also runs packed THD input, through ``varlen_attention``.

    THD call (``packed_seq_params.qkv_format == "thd"``): query ``[T, heads, head_dim]``, key/value
    ``[T, query_groups, head_dim]`` (what ``Attention.forward`` passes after squeezing the batch axis), output
    ``[T, heads * head_dim]``. Causal within each sequence for ``AttnMaskType.causal``/``padding_causal``, full
    within each sequence for ``no_mask``. The scale is Megatron's (``softmax_scale`` or ``1/sqrt(head_dim)``, with
    ``apply_query_key_layer_scaling`` folded back in, as its fused softmax does). Any other call is
    ``DotProductAttention.forward`` unchanged.

    Raises (at construction): ``softmax_type`` other than ``"vanilla"``, context parallel size > 1. (At a THD
    call): an attention mask or bias, attention dropout while training, a sliding window.
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type != "vanilla":
            raise NotImplementedError(
                f"PackgraphDotProductAttention: softmax_type={softmax_type!r} is not supported (FlashAttention's "
                "varlen kernel has no softmax offset); use softmax_type='vanilla'"
            )
        _refuse_context_parallel(config, "PackgraphDotProductAttention")
        super().__init__(config, *args, **kwargs)
        coeff = self.layer_number if getattr(config, "apply_query_key_layer_scaling", False) else 1
        self.varlen_softmax_scale = float(self.softmax_scale) * coeff

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
        **kwargs: Any,
    ) -> Tensor:
        if not _is_thd(packed_seq_params):
            return super().forward(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
                **kwargs,
            )
        self._check_thd_call(attention_mask, attention_bias, kwargs)
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type in _CAUSAL_MASKS:
            causal = True
        elif mask_type == _NO_MASK:
            causal = False
        else:
            raise NotImplementedError(
                f"PackgraphDotProductAttention: attn_mask_type={mask_type} on THD input; packed sequences are "
                "masked by cu_seqlens, use AttnMaskType.causal or no_mask"
            )
        params = _as_packgraph(packed_seq_params)
        out = varlen_attention(query, key, value, params, causal=causal, softmax_scale=self.varlen_softmax_scale)
        return out.reshape(out.shape[0], -1)

    def _check_thd_call(self, attention_mask: Any, attention_bias: Any, extra: dict) -> None:
        if attention_mask is not None:
            raise ValueError(
                "PackgraphDotProductAttention: pass attention_mask=None with packed THD batches; cu_seqlens give the "
                "mask (causal within each sequence)"
            )
        if attention_bias is not None:
            raise NotImplementedError("PackgraphDotProductAttention: attention_bias is not supported on THD input")
        unexpected = sorted(name for name, value in extra.items() if value is not None)
        if unexpected:
            raise TypeError(f"PackgraphDotProductAttention: unexpected arguments on THD input: {unexpected}")
        if self.training and self.attention_dropout.p > 0:
            raise NotImplementedError(
                f"PackgraphDotProductAttention: attention_dropout={self.attention_dropout.p} while training on THD "
                "input; the varlen kernel has no dropout. Set TransformerConfig(attention_dropout=0.0)"
            )
        if getattr(self.config, "window_size", None) is not None:
            raise NotImplementedError(
                f"PackgraphDotProductAttention: sliding-window attention (window_size={self.config.window_size}) "
                "is not supported on THD input"
            )


# ---------------------------------------------------------------------------------------------------- RoPE
def _rotate_half(x: Tensor, interleaved: bool) -> Tensor:
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotate_thd(t: Tensor, freqs: Tensor, positions: Tensor, *, interleaved: bool, mscale: float) -> Tensor:
    """Megatron's rotary formula on ``t`` ``[T, 1, heads, head_dim]`` with row ``r`` at ``positions[r]``.

    ``freqs`` is Megatron's table ``[S, 1, 1, rot_dim]`` (``RotaryEmbedding``'s output, angle of each position);
    positions past ``S - 1`` (dead rows only, when ``S`` bounds every real length) read the last entry. The
    arithmetic is ``_apply_rotary_pos_emb_bshd``'s, in the same order, so each row matches the bshd path exactly.
    Device ops with fixed shapes: no host sync.
    """
    rows = freqs.index_select(0, positions.clamp(max=freqs.shape[0] - 1))  # [T, 1, 1, rot_dim]
    rot_dim = rows.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos = (torch.cos(rows) * mscale).to(t.dtype)
    sin = (torch.sin(rows) * mscale).to(t.dtype)
    t = (t * cos) + (_rotate_half(t, interleaved) * sin)
    return torch.cat((t, t_pass), dim=-1)


def _yarn_mscale(attention: Any, config: Any) -> float:
    cached = getattr(attention, "_yarn_concentration_factor", None)  # Megatron >= 0.17 keeps it on the module
    if cached is not None:
        return float(cached)
    from megatron.core.transformer import attention as attention_module

    factor = getattr(attention_module, "_yarn_get_concentration_factor_from_config", None)
    return float(factor(config)) if factor is not None else 1.0


class PackgraphSelfAttention(SelfAttention):
    """Megatron's ``SelfAttention`` with a graph-safe rotary embedding on THD input.

    On a THD call with a rotary table (and no inference context) the table is held back from
    ``SelfAttention.forward`` (which would run Megatron's ``_apply_rotary_pos_emb_thd``) and applied by
    :func:`rotate_thd` to the query and key that ``get_query_key_value_tensors`` returns, at each row's position
    within its sequence, computed on the device. Every other call is ``SelfAttention.forward`` unchanged.

    Raises: multi-latent attention (at construction), mRoPE tables (``[S, b > 1, 1, d]``) and context-parallel
    params on THD input.
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(config, "multi_latent_attention", False):
            raise NotImplementedError(
                "PackgraphSelfAttention: multi-latent attention (MLA) is not supported by the packgraph spec"
            )
        _refuse_context_parallel(config, "PackgraphSelfAttention")
        super().__init__(config, *args, **kwargs)
        self._forward_signature = inspect.signature(super().forward)
        self._rope_mscale = _yarn_mscale(self, config)
        self._pending_rope: tuple[Any, Any, Any] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        bound = self._forward_signature.bind(*args, **kwargs)
        call = bound.arguments
        params = call.get("packed_seq_params")
        rotary = call.get("rotary_pos_emb")
        inference = call.get("inference_context") is not None or call.get("inference_params") is not None
        if not _is_thd(params) or rotary is None or inference:
            return super().forward(*args, **kwargs)
        no_rope = getattr(self.config, "no_rope_freq", None)
        if no_rope and no_rope[self.layer_number - 1]:
            return super().forward(*args, **kwargs)  # Megatron drops the table for this layer itself
        q_freqs, k_freqs = rotary if isinstance(rotary, tuple) else (rotary, rotary)
        for freqs in (q_freqs, k_freqs):
            if freqs is not None and (freqs.dim() != 4 or freqs.shape[1] != 1):
                raise NotImplementedError(
                    f"PackgraphSelfAttention: rotary table of shape {tuple(freqs.shape)} on THD input; only "
                    "[S, 1, 1, rot_dim] tables (RotaryEmbedding, YaRN) are supported, not mRoPE"
                )
        call["rotary_pos_emb"] = None
        self._pending_rope = (q_freqs, k_freqs, _as_packgraph(params))
        try:
            return super().forward(*bound.args, **bound.kwargs)
        finally:
            self._pending_rope = None

    def get_query_key_value_tensors(self, *args: Any, **kwargs: Any) -> Any:
        out = super().get_query_key_value_tensors(*args, **kwargs)
        if self._pending_rope is None:
            return out
        if len(out) < 3:  # (mixed_qkv, split sizes): never chosen for packed input, which always splits
            raise RuntimeError("PackgraphSelfAttention: THD rotary needs split query/key/value tensors")
        q_freqs, k_freqs, params = self._pending_rope
        self._pending_rope = None  # applied once, whatever else calls this method
        query, key = out[0], out[1]
        interleaved = bool(getattr(self.config, "rotary_interleaved", False))
        if q_freqs is not None:
            pos_q = row_layout(params, "q", query.shape[0]).pos
            query = rotate_thd(query, q_freqs, pos_q, interleaved=interleaved, mscale=self._rope_mscale)
        if k_freqs is not None:
            pos_k = row_layout(params, "kv", key.shape[0]).pos
            key = rotate_thd(key, k_freqs, pos_k, interleaved=interleaved, mscale=self._rope_mscale)
        return (query, key, *out[2:])


# ---------------------------------------------------------------------------------------------------- the spec
def get_gpt_layer_packgraph_spec(
    num_experts: int | None = None,
    moe_grouped_gemm: bool | None = False,
    qk_layernorm: bool | None = False,
    multi_latent_attention: bool | None = False,
    normalization: str | None = None,
    qk_l2_norm: bool | None = False,
    **local_spec_kwargs: Any,
) -> ModuleSpec:
    """A ``TransformerLayer`` spec like ``get_gpt_layer_local_spec``, whose attention runs packed THD batches.

    It is Megatron's local spec built with the same arguments (those the installed version takes; others must keep
    their defaults) with :class:`PackgraphSelfAttention` and :class:`PackgraphDotProductAttention` in place of
    ``SelfAttention`` and ``DotProductAttention``. Parameter names and ``state_dict`` keys are the local spec's, so
    weights load both ways. Use it as ``GPTModel(config, get_gpt_layer_packgraph_spec(...), ...)`` and call the
    model with ``packed_seq_params`` (qkv_format ``"thd"``, Megatron's class or packgraph's), ``input_ids`` and
    ``position_ids`` of shape ``[1, T]`` and ``attention_mask=None``; without ``packed_seq_params`` it is the local
    spec.

    Raises:
        NotImplementedError: ``multi_latent_attention=True``.
        TypeError: an argument this Megatron-Core's ``get_gpt_layer_local_spec`` does not take, with a value.
    """
    if multi_latent_attention:
        raise NotImplementedError("get_gpt_layer_packgraph_spec: multi-latent attention (MLA) is not supported")
    wanted = dict(
        num_experts=num_experts,
        moe_grouped_gemm=moe_grouped_gemm,
        qk_layernorm=qk_layernorm,
        normalization=normalization,
        qk_l2_norm=qk_l2_norm,
        **local_spec_kwargs,
    )
    accepted = inspect.signature(get_gpt_layer_local_spec).parameters
    unknown = sorted(name for name, value in wanted.items() if name not in accepted and value not in (None, False))
    if unknown:
        raise TypeError(f"get_gpt_layer_packgraph_spec: this Megatron-Core's local spec does not take {unknown}")
    spec = get_gpt_layer_local_spec(**{name: value for name, value in wanted.items() if name in accepted})
    attention = spec.submodules.self_attention
    if getattr(attention, "module", None) is not SelfAttention:
        raise RuntimeError(
            f"get_gpt_layer_packgraph_spec: Megatron's local spec has self_attention={attention!r}, expected a "
            "ModuleSpec of SelfAttention; this Megatron-Core version is not supported yet"
        )
    core = dataclasses.replace(attention.submodules, core_attention=PackgraphDotProductAttention)
    attention = dataclasses.replace(attention, module=PackgraphSelfAttention, submodules=core)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))
