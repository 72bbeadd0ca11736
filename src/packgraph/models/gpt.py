"""A reference GPT on packed (THD) batches, nanoGPT-style: one file, no framework.

The input is one token stream ``tokens [T]`` plus :class:`~packgraph.params.PackedSeqParams`; every hidden
state is ``[T, d_model]``. Documents never see each other: attention is block-diagonal causal
(:func:`~packgraph.ops.varlen_attention`) and RoPE positions restart at each document
(:func:`~packgraph.ops.apply_rope_thd`). Rows that belong to no document ("dead" rows: tail and padding) carry
garbage hidden states that nothing reads, and their labels are ``-100``.

Each :class:`Block` is ``mlp(attn(x))``, two separate modules (``block.attn``, ``block.mlp``) so that either half
can run in a CUDA graph while the other runs eagerly: :meth:`GPT.graphed` builds such wrappers (:data:`SCOPES`).

Loss normalisation: ``loss = sum_r loss_mask[r] * CE(logits[r], labels[r]) / sum_r loss_mask[r]`` over the rows
of the batch, i.e. the mean over real target tokens. Rows with ``labels == -100`` contribute zero whatever
their mask. Gradient accumulation over micro-batches weights each micro-batch's loss by its share of the real
target tokens (see :mod:`packgraph.train`), which equals one big batch's mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from packgraph.distributed.cp import cp_position_ids, cp_varlen_attention
from packgraph.ops import apply_rope_thd, varlen_attention
from packgraph.ops.attention import BACKENDS
from packgraph.ops.doc_mask import document_block_mask
from packgraph.params import PackedSeqParams

if TYPE_CHECKING:
    from collections.abc import Callable

    from packgraph.buckets import BucketPolicy
    from packgraph.packing import PackedBatch

__all__ = ["GPTConfig", "RMSNorm", "AttentionBlock", "MLPBlock", "Block", "GPT", "GraphedGPT", "SCOPES"]

SCOPES: tuple[str, ...] = ("layer", "attn", "mlp", "model")
"""What :meth:`GPT.graphed` can capture: whole blocks, only their attention half, only their MLP half, or the
whole forward+backward of the loss."""

IGNORE_INDEX = -100


@dataclass
class GPTConfig:
    """Model shape. ``n_kv_head`` < ``n_head`` gives grouped-query attention; ``None`` means ``n_head``.

    ``mlp_hidden=None`` uses the SwiGLU convention ``8/3 * d_model`` rounded up to a multiple of 64.
    ``dropout`` applies to each residual branch's output (the attention kernel has no dropout).
    ``attention_backend`` is ``varlen_attention``'s: ``"flash"`` (FlashAttention-2, bucketed ``max_seqlen`` and
    capacity) or ``"doc_mask"`` (FlexAttention with a document mask: one graph per layer for every packing, with
    :func:`~packgraph.buckets.document_mask_buckets`).
    """

    vocab_size: int = 258
    n_layer: int = 12
    n_head: int = 8
    n_kv_head: int | None = None
    d_model: int = 512
    mlp_hidden: int | None = None
    rope_base: float = 10000.0
    dropout: float = 0.0
    init_std: float = 0.02
    norm_eps: float = 1e-5
    attention_backend: str = "flash"

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.mlp_hidden is None:
            self.mlp_hidden = 64 * math.ceil(8 * self.d_model / 3 / 64)
        if self.d_model % self.n_head != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named shape (see :data:`PRESETS`), with optional field overrides.

        Raises:
            ValueError: unknown preset name (the message lists the known ones).
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def num_params(self) -> int:
        """Parameter count (tied head counted once)."""
        qkv = self.d_model * (self.n_head + 2 * self.n_kv_head) * self.head_dim
        attn = qkv + self.n_head * self.head_dim * self.d_model  # and the output projection
        mlp = 3 * self.d_model * self.mlp_hidden
        return self.vocab_size * self.d_model + self.n_layer * (attn + mlp + 2 * self.d_model) + self.d_model


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=64, n_layer=2, n_head=4),  # trains on a laptop CPU in seconds
    "small": dict(d_model=512, n_layer=12, n_head=8),
    "medium": dict(d_model=1024, n_layer=16, n_head=16),
    "large": dict(d_model=2048, n_layer=24, n_head=16),
}


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 (float64 for float64 input), returned in ``x``'s dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        compute = _at_least_fp32(x.dtype)
        xf = x.to(compute)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(compute)).to(x.dtype)


class AttentionBlock(nn.Module):
    """Pre-norm attention with its residual: ``x + proj(attn(rope(q), rope(k), v))``. ``x``: ``[T, d_model]``.

    Only ``cu_seqlens*`` and the static max seqlens are read from the params (``attention_view``), so the
    Mamba-only fields never enter an attention graph.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.rope_base = cfg.rope_base
        self.backend = cfg.attention_backend
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, bias=False)
        self.proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self, x: Tensor, packed_seq_params: PackedSeqParams, doc_mask: tuple[Any, Tensor] | None = None
    ) -> Tensor:
        params = packed_seq_params.attention_view()
        T = x.shape[0]
        q, k, v = self.qkv(self.norm(x)).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1
        )
        # Context parallel (params from packgraph.distributed.shard_thd_for_cp): these rows are one rank's shard
        # of the stream, so RoPE takes their positions in the whole sequences and attention gathers K/V.
        cp = params.local_cp_size is not None and params.local_cp_size > 1
        positions = cp_position_ids(params, total_tokens=T) if cp else None
        q = apply_rope_thd(q.view(T, self.n_head, self.head_dim), params, base=self.rope_base, position_ids=positions)
        k = apply_rope_thd(
            k.view(T, self.n_kv_head, self.head_dim), params, base=self.rope_base, position_ids=positions
        )
        v = v.view(T, self.n_kv_head, self.head_dim)
        if cp:
            if self.backend != "flash":
                raise NotImplementedError(
                    f"context parallel attention runs FlashAttention: attention_backend {self.backend!r} is not "
                    "supported with local_cp_size > 1; use attention_backend='flash'"
                )
            y = cp_varlen_attention(q, k, v, params, causal=True)
        else:
            mask = doc_mask if self.backend == "doc_mask" else None
            y = varlen_attention(q, k, v, params, causal=True, backend=self.backend, mask=mask)
        return x + self.dropout(self.proj(y.reshape(T, self.n_head * self.head_dim)))


class MLPBlock(nn.Module):
    """Pre-norm SwiGLU MLP with its residual: ``x + down(silu(gate) * up)``. Row-wise: needs no packing info."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return x + self.dropout(self.down(F.silu(gate) * up))


class Block(nn.Module):
    """One transformer layer: ``mlp(attn(x, params))``. The halves are separate so each can be graphed alone."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn = AttentionBlock(cfg)
        self.mlp = MLPBlock(cfg)

    def forward(
        self, x: Tensor, packed_seq_params: PackedSeqParams, doc_mask: tuple[Any, Tensor] | None = None
    ) -> Tensor:
        # Only a mask is passed on: an attention module swapped in for AttentionBlock takes ``(x, params)``.
        args = (x, packed_seq_params) if doc_mask is None else (x, packed_seq_params, doc_mask)
        return self.mlp(self.attn(*args))


def _unpack(
    batch: PackedBatch | Tensor,
    packed_seq_params: PackedSeqParams | None,
    labels: Tensor | None,
    loss_mask: Tensor | None,
    *,
    need_labels: bool = False,
) -> tuple[Tensor, PackedSeqParams, Tensor | None, Tensor | None]:
    """``(tokens, params, labels, loss_mask)`` from a PackedBatch or loose tensors; explicit args win.

    ``need_labels``: raise unless labels are found (``token_logprobs`` cannot run without them).
    """
    if isinstance(batch, Tensor):
        tokens = batch
    else:
        tokens = batch.tokens
        packed_seq_params = packed_seq_params if packed_seq_params is not None else batch.packed_seq_params
        labels = labels if labels is not None else batch.labels
        loss_mask = loss_mask if loss_mask is not None else batch.loss_mask
    if packed_seq_params is None:
        raise ValueError("packed_seq_params is required with a tokens tensor (or pass a PackedBatch)")
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D [T] (THD layout), got shape {tuple(tokens.shape)}")
    if need_labels and labels is None:
        raise ValueError("token_logprobs needs labels (pass a PackedBatch or labels=)")
    return tokens, packed_seq_params, labels, loss_mask


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def masked_mean_ce(logits: Tensor, labels: Tensor, loss_mask: Tensor | None) -> Tensor:
    """``sum(mask * CE) / sum(mask)`` in float32 (float64 for a float64 model).

    Rows with label -100 contribute 0. Sync-free, so it can run inside a graph.
    """
    ce = F.cross_entropy(logits.to(_at_least_fp32(logits.dtype)), labels, ignore_index=IGNORE_INDEX, reduction="none")
    mask = (labels != IGNORE_INDEX).to(ce.dtype) if loss_mask is None else loss_mask.to(ce.dtype)
    # clamp: a batch with no targets gives loss 0 rather than NaN.
    return (ce * mask).sum() / mask.sum().clamp_min(1.0)


class GPT(nn.Module):
    """Token embedding -> ``n_layer`` blocks -> final RMSNorm -> tied LM head, on a packed stream."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, init_std), residual output projections scaled by ``1/sqrt(2 n_layer)``."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name == "norm_f.weight":
                nn.init.ones_(p)
            elif name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.cfg.n_layer))
            else:
                nn.init.normal_(p, 0.0, std)

    # ------------------------------------------------------------------ pieces (the graphed wrapper reuses them)
    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """``[T]`` int64 -> ``[T, d_model]``."""
        return self.embed(tokens)

    def forward_hidden(self, tokens: Tensor, packed_seq_params: PackedSeqParams) -> Tensor:
        """Embedding and the block stack: ``[T]`` -> ``[T, d_model]`` (before the final norm)."""
        x = self.embed_tokens(tokens)
        doc_mask = self.document_mask(packed_seq_params, tokens)
        for block in self.blocks:
            x = block(x, packed_seq_params, doc_mask)
        return x

    def document_mask(self, packed_seq_params: PackedSeqParams, tokens: Tensor) -> tuple[Any, Tensor] | None:
        """The document mask of the layers on the ``"doc_mask"`` backend, built once per forward, which every
        such layer reads (None when none is, or under context parallel, whose attention runs FA2)."""
        params = packed_seq_params.attention_view()
        on_doc_mask = any(getattr(b.attn, "backend", None) == "doc_mask" for b in self.blocks)  # swapped: none
        if not on_doc_mask or (params.local_cp_size or 1) > 1:
            return None
        return document_block_mask(params, tokens.shape[0], tokens.device, compiled=tokens.is_cuda)

    def logits_from_hidden(self, hidden: Tensor) -> Tensor:
        """Final norm and tied head: ``[T, d_model]`` -> ``[T, vocab_size]``."""
        return F.linear(self.norm_f(hidden), self.embed.weight)

    def loss_from_hidden(
        self, hidden: Tensor, labels: Tensor, loss_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """``(logits [T, V], loss [])``; loss is the masked mean CE described in the module docstring."""
        logits = self.logits_from_hidden(hidden)
        return logits, masked_mean_ce(logits, labels, loss_mask)

    # ------------------------------------------------------------------ public
    def forward(
        self,
        batch: PackedBatch | Tensor,
        packed_seq_params: PackedSeqParams | None = None,
        labels: Tensor | None = None,
        loss_mask: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Logits ``[T, V]``, or ``(logits, loss)`` when labels are given (a PackedBatch always has them)."""
        tokens, params, labels, loss_mask = _unpack(batch, packed_seq_params, labels, loss_mask)
        hidden = self.forward_hidden(tokens, params)
        if labels is None:
            return self.logits_from_hidden(hidden)
        return self.loss_from_hidden(hidden, labels, loss_mask)

    @torch.no_grad()
    def token_logprobs(
        self,
        batch: PackedBatch | Tensor,
        packed_seq_params: PackedSeqParams | None = None,
        labels: Tensor | None = None,
    ) -> Tensor:
        """float32 ``[T]``: ``log p(labels[r] | tokens of its document up to r)``; 0 where ``labels == -100``."""
        tokens, params, labels, _ = _unpack(batch, packed_seq_params, labels, None, need_labels=True)
        return logprobs_of_labels(self.logits_from_hidden(self.forward_hidden(tokens, params)), labels)

    def graphed(
        self,
        scope: str = "layer",
        buckets: BucketPolicy | None = None,
        sample_batch: PackedBatch | None = None,
        forward_only: bool = False,
        **capture_opts: Any,
    ) -> GraphedGPT:
        """A wrapper with the same ``forward``/``token_logprobs`` that runs part of the model in CUDA graphs.

        Args:
            scope: ``"layer"`` graphs every block (``capture_layers``, one pool); ``"attn"``/``"mlp"`` graph only
                that half of each block, the other half eager; ``"model"`` graphs the whole loss forward and
                backward (its ``forward`` then returns ``(None, loss)``: the logits stay inside the graph).
                Embedding, head and loss are eager in every scope but ``"model"``.
            buckets: a ``BucketPolicy`` for the engine: each batch replays its bucket's graphs (:class:`GraphedGPT`).
            sample_batch: capture the first graph set now from this batch's shape instead of at the first call.
            forward_only: no-grad graphs (scoring/eval). Call the wrapper under ``torch.no_grad()``.
            capture_opts: passed to :func:`packgraph.capture` / :func:`packgraph.capture_layers`.

        Raises:
            RuntimeError: the model is not on a CUDA device (graphs need CUDA; CPU tests use
                ``packgraph.graphs.use_recorder``), at the first capture.
            ValueError: unknown scope.
        """
        return GraphedGPT(
            self, scope=scope, buckets=buckets, sample_batch=sample_batch, forward_only=forward_only, **capture_opts
        )


def _in_unit(module: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; inside ``module``'s hooks when it is an FSDP2 unit, which gather its parameters for ``fn``."""
    from packgraph.graphs.capture import call_with_forward, is_fsdp_unit

    return call_with_forward(module, fn, *args) if is_fsdp_unit(module) else fn(*args)


def logprobs_of_labels(logits: Tensor, labels: Tensor) -> Tensor:
    """float32 ``[T]`` log-softmax of each row's label, 0 where ``labels == -100``."""
    logp = torch.log_softmax(logits.to(_at_least_fp32(logits.dtype)), dim=-1)
    has_target = labels != IGNORE_INDEX
    picked = logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return torch.where(has_target, picked, torch.zeros_like(picked)).float()


class _LossModule(nn.Module):
    """The whole loss as one module (scope "model"): ``(tokens, labels, loss_mask, params) -> loss``."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, labels: Tensor, loss_mask: Tensor, packed_seq_params: PackedSeqParams) -> Tensor:
        return self.model(tokens, packed_seq_params, labels, loss_mask)[1]


class _LogprobModule(nn.Module):
    """Token logprobs as one module (scope "model", forward-only)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, labels: Tensor, packed_seq_params: PackedSeqParams) -> Tensor:
        hidden = self.model.forward_hidden(tokens, packed_seq_params)
        return logprobs_of_labels(self.model.logits_from_hidden(hidden), labels)


class GraphedGPT(nn.Module):
    """A :class:`GPT` whose block stack (or a part of it) replays CUDA graphs. Build with :meth:`GPT.graphed`.

    One engine capture serves every batch: one :func:`~packgraph.graphs.capture_layers` call over the blocks (or
    their halves; scope ``"model"``: one :func:`~packgraph.graphs.capture` of the whole loss) with the bucket
    policy, so all buckets share one capture group, one memory pool, one set of forward buffers per layer (the
    grads of buckets not in use go back to the pool) and one cache. The engine captures a new bucket at its first
    call, in the caller's context (autocast, grad mode). Parameters are the wrapped model's (``self.model``): save
    ``graphed.model.state_dict()``.
    """

    def __init__(
        self,
        model: GPT,
        *,
        scope: str = "layer",
        buckets: BucketPolicy | None = None,
        sample_batch: PackedBatch | None = None,
        forward_only: bool = False,
        **capture_opts: Any,
    ) -> None:
        super().__init__()
        if scope not in SCOPES:
            raise ValueError(f"unknown graph scope {scope!r}; choose one of {SCOPES}")
        from packgraph.graphs.recorder import stand_in

        device = next(model.parameters()).device
        if stand_in() is None and (device.type != "cuda" or not torch.cuda.is_available()):
            raise RuntimeError(
                f"model.graphed() needs the model on a CUDA device (CUDA graphs), but it is on {device}; "
                "move it with model.cuda() or run eagerly"
            )
        self.model = model
        self.scope = scope
        self.buckets = buckets
        self.forward_only = forward_only
        self.capture_opts = capture_opts
        self._graphed: list[Any] = []
        if sample_batch is not None:
            self._capture(sample_batch.tokens.shape[0], sample_batch.packed_seq_params)

    # ------------------------------------------------------------------ stats
    @property
    def num_graph_sets(self) -> int:
        """Signatures (buckets, mostly) the graphs currently hold."""
        return self._graphed[0].num_graphs if self._graphed else 0

    @property
    def captures(self) -> int:
        """Graph sets captured so far (one per signature met)."""
        return self._graphed[0].captures if self._graphed else 0

    @property
    def callables(self) -> list[Any]:
        """The engine's graphed callables (one per block, or one for scope ``"model"``)."""
        return list(self._graphed)

    @property
    def recaptures(self) -> int:
        """Captures beyond one per graph set and layer (a layer recaptured for another reason: a frozen
        parameter, a module switched to eval alone...)."""
        return max(0, sum(g.captures for g in self._graphed) - len(self._graphed) * self.captures)

    # ------------------------------------------------------------------ capture
    def _capture(self, T: int, params: PackedSeqParams) -> None:
        """The one engine capture, from sample inputs of ``T`` rows and ``params``' layout."""
        from packgraph.graphs import capture, capture_layers

        model, cfg = self.model, self.model.cfg
        device = next(model.parameters()).device
        opts = dict(self.capture_opts, forward_only=self.forward_only, buckets=self.buckets)
        # A private generator: sample data must not advance the global RNG (eager and graphed runs stay in step).
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(T, cfg.d_model, device=device, generator=gen, dtype=model.embed.weight.dtype)
        x.requires_grad_(not self.forward_only)
        if self.scope == "model":
            tokens = torch.randint(0, cfg.vocab_size, (T,), device=device, generator=gen)
            labels = torch.randint(0, cfg.vocab_size, (T,), device=device, generator=gen)
            if self.forward_only:
                self._graphed = [capture(_LogprobModule(model), (tokens, labels, params), **opts)]
            else:
                mask = torch.ones(T, device=device)
                self._graphed = [capture(_LossModule(model), (tokens, labels, mask, params), **opts)]
        elif self.scope == "layer":
            # chain: each block's graph reads the previous block's output buffer in place (no copies).
            self._graphed = capture_layers(list(model.blocks), (x, params), **opts)
        elif self.scope == "attn":
            # chain=False: an eager MLP sits between consecutive attention graphs.
            self._graphed = capture_layers([b.attn for b in model.blocks], (x, params), chain=False, **opts)
        else:
            self._graphed = capture_layers([b.mlp for b in model.blocks], (x,), chain=False, **opts)

    def _graphs(self, T: int, params: PackedSeqParams) -> list[Any]:
        if not self._graphed:
            self._capture(T, params)
        return self._graphed

    # ------------------------------------------------------------------ forward
    def _call(self, fn: Callable[..., Any], tokens: Tensor, params: PackedSeqParams, *rest: Any) -> Any:
        """``fn(tokens, params, *rest)`` once the graphs exist. An FSDP2 root's hooks gather the embedding and head,
        and queue the end-of-backward reduction, around the call, as they do around ``model(...)``."""
        self._graphs(tokens.shape[0], params)
        return _in_unit(self.model, fn, tokens, params, *rest)

    def forward_hidden(self, tokens: Tensor, packed_seq_params: PackedSeqParams) -> Tensor:
        """Like :meth:`GPT.forward_hidden`; the block stack (or the scope's half of it) replays graphs."""
        if self.scope == "model":
            raise RuntimeError("scope 'model' graphs the whole loss; forward_hidden is not available there")
        return self._call(self._hidden, tokens, packed_seq_params)

    def _hidden(self, tokens: Tensor, packed_seq_params: PackedSeqParams) -> Tensor:
        graphed = self._graphs(tokens.shape[0], packed_seq_params)
        if self.scope == "layer":
            # A new bucket is captured before the embedding exists, so the capture's peak holds one tensor of
            # the stack's input layout (the first block's input buffer), not that and the embedding beside it.
            weight = self.model.embed.weight
            grad = torch.is_grad_enabled() and weight.requires_grad
            shape = (tokens.shape[0], self.model.cfg.d_model)
            graphed[0].capture_ahead(shape, weight.dtype, grad, packed_seq_params)
        x = self.model.embed_tokens(tokens)
        for i, block in enumerate(self.model.blocks):
            if self.scope == "layer":
                x = graphed[i](x, packed_seq_params)
            elif self.scope == "attn":
                x = _in_unit(block, lambda h, p, g=graphed[i], b=block: b.mlp(g(h, p)), x, packed_seq_params)
            else:
                x = _in_unit(block, lambda h, p, g=graphed[i], b=block: g(b.attn(h, p)), x, packed_seq_params)
        return x

    def forward(
        self,
        batch: PackedBatch | Tensor,
        packed_seq_params: PackedSeqParams | None = None,
        labels: Tensor | None = None,
        loss_mask: Tensor | None = None,
    ) -> Tensor | tuple[Tensor | None, Tensor]:
        """Same contract as :meth:`GPT.forward`; scope ``"model"`` returns ``(None, loss)`` and needs labels."""
        tokens, params, labels, loss_mask = _unpack(batch, packed_seq_params, labels, loss_mask)
        if self.scope == "model":
            if labels is None or self.forward_only:
                raise RuntimeError("scope 'model' graphs the training loss: call it with labels, forward_only=False")
            if loss_mask is None:
                loss_mask = (labels != IGNORE_INDEX).float()
            return None, self._graphs(tokens.shape[0], params)[0](tokens, labels, loss_mask, params)
        return self._call(self._logits_or_loss, tokens, params, labels, loss_mask)

    def _logits_or_loss(
        self, tokens: Tensor, params: PackedSeqParams, labels: Tensor | None, loss_mask: Tensor | None
    ) -> Tensor | tuple[Tensor | None, Tensor]:
        hidden = self._hidden(tokens, params)
        if labels is None:
            return self.model.logits_from_hidden(hidden)
        return self.model.loss_from_hidden(hidden, labels, loss_mask)

    @torch.no_grad()
    def token_logprobs(
        self,
        batch: PackedBatch | Tensor,
        packed_seq_params: PackedSeqParams | None = None,
        labels: Tensor | None = None,
    ) -> Tensor:
        """Same contract as :meth:`GPT.token_logprobs`, through the graphs (use ``forward_only=True``)."""
        tokens, params, labels, _ = _unpack(batch, packed_seq_params, labels, None, need_labels=True)
        if self.scope == "model":
            if not self.forward_only:
                raise RuntimeError("scope 'model' logprobs need a forward_only=True wrapper")
            return self._graphs(tokens.shape[0], params)[0](tokens, labels, params)
        return self._call(self._logprobs, tokens, params, labels)

    def _logprobs(self, tokens: Tensor, params: PackedSeqParams, labels: Tensor) -> Tensor:
        return logprobs_of_labels(self.model.logits_from_hidden(self._hidden(tokens, params)), labels)
