"""Hugging Face transformers: packed (THD) batches, the ``"packgraph"`` attention, and graphed decoder layers.

Three pieces, usable alone:

* **Attention.** Importing this module registers an attention function named ``"packgraph"`` in transformers'
  ``AttentionInterface``. A model loaded with ``attn_implementation="packgraph"`` (any model whose attention goes
  through that interface; checked: the families of :mod:`packgraph.integrations.hf_families`, sliding windows per
  layer, softcapping and attention sinks included) runs packed batches through
  :func:`packgraph.ops.varlen_attention`. Packing metadata comes from the kwargs the model forwards to its
  attention: a ``packed_seq_params`` (packgraph's or Megatron's) or HF's flash kwargs ``cu_seq_lens_q``,
  ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k``. The max lengths must be Python ints (static): the function
  never calls ``.item()``, so it runs inside a CUDA graph. Transformers (5.x) forwards the ``**kwargs`` of
  ``model(...)`` through every decoder layer to the attention function, so metadata given to the model arrives here;
  for a custom attention name it builds no mask, hence never runs its ``position_ids`` packing detection (which
  reads device values).
* **Batches.** :func:`from_flattening_batch` and :func:`to_flattening_batch` convert between a
  ``transformers.DataCollatorWithFlattening`` output and a fixed-shape :class:`~packgraph.packing.PackedBatch`
  (defined in :mod:`packgraph.integrations.hf_batches`, which also states the label convention, and re-exported
  here); :func:`packed_forward` runs the model on a ``PackedBatch``.
* **Graphs.** :func:`graph_decoder_layers` captures each decoder layer (or its attention or MLP) of an HF causal
  LM with :func:`packgraph.capture_layers`; embeddings, rotary tables, final norm, head and loss stay eager.

``transformers.Trainer`` (and TRL's ``SFTTrainer``) users get all three through
:mod:`packgraph.integrations.hf_trainer`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

try:
    from transformers import AttentionInterface
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError("packgraph.integrations.hf needs Hugging Face transformers: pip install 'packgraph[hf]'") from exc

from packgraph.buckets import BucketPolicy
from packgraph.graphs.capture import is_dtensor, is_fsdp_unit
from packgraph.host_syncs import GraphCaptureError
from packgraph.integrations.hf_batches import from_flattening_batch, to_flattening_batch
from packgraph.ops import varlen_attention
from packgraph.packing import PackedBatch
from packgraph.params import PackedSeqParams, PackedSeqParamsError

__all__ = [
    "ATTENTION_NAME",
    "ATTENTION_NAMES",
    "DOC_MASK_ATTENTION_NAME",
    "SCOPES",
    "GraphedDecoderLayers",
    "attention_window",
    "from_flattening_batch",
    "graph_decoder_layers",
    "packed_forward",
    "packed_loss",
    "packed_params_from_kwargs",
    "packgraph_attention",
    "packgraph_doc_mask_attention",
    "register_packgraph_attention",
    "to_flattening_batch",
]

ATTENTION_NAME = "packgraph"
"""The ``attn_implementation`` name this module registers (``varlen_attention``'s FlashAttention backend)."""
DOC_MASK_ATTENTION_NAME = "packgraph_doc_mask"
"""The same attention on ``varlen_attention``'s document-mask backend (FlexAttention): one graph per layer for every
packing, with :func:`~packgraph.buckets.document_mask_buckets` as the bucket policy."""
ATTENTION_NAMES = (ATTENTION_NAME, DOC_MASK_ATTENTION_NAME)

_HF_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
SCOPES: tuple[str, ...] = ("layer", "attn", "mlp")
"""What :func:`graph_decoder_layers` can capture: whole decoder layers, only their ``self_attn``, or only their
``mlp``; the names :meth:`packgraph.models.GPT.graphed` and Megatron's ``graph_transformer_layers`` use."""
# Deprecated spellings still accepted, with a FutureWarning naming the current one.
_SCOPE_ALIASES = {"attention": "attn"}
# Kwargs a decoder layer receives that do not change its output on a packed batch without a cache: they are
# dropped at a graphed layer's boundary (position_ids only feeds rotary tables the model already computed).
_IGNORED_LAYER_KWARGS = frozenset(
    {"position_ids", "cache_position", "use_cache", "shift_labels", "labels", "num_items_in_batch", "seq_idx"}
    | {"output_attentions", "output_hidden_states", "output_router_logits", *_HF_PACKING_KWARGS}
)
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")  # layer_past: GPT-NeoX
# What a decoder layer calls its attention: Llama-like models "self_attn", GPT-NeoX "attention".
_ATTENTION_NAMES = ("self_attn", "attention")


# ---------------------------------------------------------------------------------------------------- attention
def register_packgraph_attention() -> str:
    """Register :func:`packgraph_attention` as ``"packgraph"`` and :func:`packgraph_doc_mask_attention` as
    ``"packgraph_doc_mask"`` in ``AttentionInterface``; idempotent.

    Called on import of this module. Returns the name to pass as ``attn_implementation`` for the default backend.
    """
    for name, fn in ((ATTENTION_NAME, packgraph_attention), (DOC_MASK_ATTENTION_NAME, packgraph_doc_mask_attention)):
        if AttentionInterface._global_mapping.get(name) is not fn:
            AttentionInterface.register(name, fn)
    return ATTENTION_NAME


def packgraph_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Transformers attention function over a packed batch: ``varlen_attention`` on the THD view.

    Args:
        query: ``[1, Hq, T, D]``; key, value: ``[1, Hkv, T, D]`` (GQA is native: kv heads are not repeated).
        attention_mask: must be ``None`` (transformers builds none for this implementation); documents are
            separated by the packing metadata, never by a mask.
        scaling: softmax scale (``None``: ``D ** -0.5``).
        dropout: must be 0 (the varlen kernel runs without attention dropout).
        kwargs: packing metadata, one of ``packed_seq_params`` or ``cu_seq_lens_q``/``cu_seq_lens_k`` with
            static int ``max_length_q``/``max_length_k``; ``is_causal`` (default: the module's, else True); and
            what the layer passes to every attention function: ``sliding_window`` (this layer's window, ``None``
            on a global layer), ``softcap`` (attention logit softcapping), ``s_aux`` (per-head attention sinks).

    Window semantics are transformers' own: ``sliding_window=W`` lets a query see itself and the ``W - 1`` tokens
    before it in its document (``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - W``, the eager and
    sdpa masks), which is FlashAttention's ``window_size=(W - 1, W - 1)`` under ``causal`` as transformers' flash
    path passes it. Here: ``window=(W - 1, 0)`` causal, ``(W - 1, W - 1)`` otherwise (the flash path's symmetric
    window), and no window at all when the bucket's static ``max_seqlen`` is at most ``W`` (it cannot matter then,
    as the flash path skips it when ``key_length <= W``). ``softcap=c`` is ``c * tanh(scores / c)`` on the scaled
    scores, and ``s_aux`` one extra logit per query head in each row's softmax that attends to no value, as in the
    eager paths of Gemma 2 and gpt-oss.

    Returns:
        ``(attn_output [1, T, Hq, D], None)``: transformers' layout; no attention weights.

    Raises:
        ValueError / PackedSeqParamsError: batch size above 1, a mask, missing metadata, or tensor max lengths.
        NotImplementedError: dropout.
    """
    return _packed_attention("flash", module, query, key, value, attention_mask, scaling, dropout, kwargs)


def _packed_attention(
    backend: str,
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> tuple[Tensor, None]:
    """:func:`packgraph_attention`'s body, on ``varlen_attention``'s ``backend``."""
    if query.shape[0] != 1:
        raise ValueError(
            f"attn_implementation='packgraph' runs packed batches of batch size 1 ([1, T] inputs), got batch size "
            f"{query.shape[0]}: flatten the batch (DataCollatorWithFlattening, from_flattening_batch)"
        )
    if attention_mask is not None:
        raise ValueError(
            "attn_implementation='packgraph' takes no attention mask: documents are separated by cu_seqlens. "
            "Drop attention_mask from the model call."
        )
    if dropout:
        raise NotImplementedError(f"attn_implementation='packgraph' has no attention dropout (got p={dropout})")
    params = packed_params_from_kwargs(kwargs)
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(is_causal)
    # [1, H, T, D] -> [T, H, D] is a view; RoPE leaves q/k with token-major strides, so no copy happens here.
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    dtype = _attention_dtype(q)
    if dtype is not None:
        # Under autocast the projections come out in the autocast dtype but RoPE's float32 tables promote q and k
        # back to float32; SDPA would cast all three down (it is an autocast op), and FA2 needs one dtype.
        q, k, v = (x.to(dtype) for x in (q, k, v))
    # Only what a layer uses is passed on: a plain layer's call is the same call as before windows existed.
    options: dict[str, Any] = {}
    window = attention_window(kwargs.get("sliding_window"), params, causal=is_causal)
    if window is not None:
        options["window"] = window
    if kwargs.get("softcap") is not None:
        options["softcap"] = float(kwargs["softcap"])
    if kwargs.get("s_aux") is not None:
        options["sinks"] = kwargs["s_aux"]
    out = varlen_attention(q, k, v, params, causal=is_causal, softmax_scale=scaling, backend=backend, **options)
    return out.unsqueeze(0), None


def packgraph_doc_mask_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """:func:`packgraph_attention` on ``varlen_attention``'s ``"doc_mask"`` backend (``attn_implementation=
    "packgraph_doc_mask"``): same arguments, windows and softcapping; attention sinks are refused by name."""
    return _packed_attention("doc_mask", module, query, key, value, attention_mask, scaling, dropout, kwargs)


def attention_window(
    sliding_window: int | None, params: PackedSeqParams, *, causal: bool = True
) -> tuple[int, int] | None:
    """``varlen_attention``'s ``window=(left, right)`` for a layer's HF ``sliding_window`` (None: no window).

    HF's ``sliding_window=W`` is the number of tokens a causal query sees, itself included (``kv_idx > q_idx - W``
    in ``transformers.masking_utils``); FlashAttention counts the tokens on each side, itself excluded, so
    transformers' flash path passes ``window_size=(W - 1, W - 1)``. A causal window is ``(W - 1, 0)`` here, a
    bidirectional one ``(W - 1, W - 1)`` like the flash path's. When the static ``max_seqlen`` of the params is at
    most ``W`` no document can be longer than the window and None is returned: the call is then exactly the
    windowless one (and its graph the same).

    Raises:
        ValueError: ``W`` below 1.
    """
    if sliding_window is None:
        return None
    w = int(sliding_window)
    if w < 1:
        raise ValueError(f"sliding_window must be >= 1 (the tokens a query sees, itself included), got {w}")
    bounds = [m for m in (params.max_seqlen_q, params.max_seqlen_kv) if m is not None]
    if bounds and max(bounds) <= w:
        return None
    return (w - 1, 0) if causal else (w - 1, w - 1)


def _attention_dtype(q: Tensor) -> torch.dtype | None:
    """The autocast dtype of ``q``'s device when autocast is on there, else None."""
    device_type = q.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def packed_params_from_kwargs(kwargs: Mapping[str, Any]) -> PackedSeqParams:
    """The attention view of the packing metadata in a model call's kwargs (no host sync).

    ``packed_seq_params`` (packgraph's, or any object with Megatron's field names) wins over HF's flash kwargs.

    Raises:
        PackedSeqParamsError: no metadata, or a max length given as a tensor.
    """
    params = kwargs.get("packed_seq_params")
    if params is not None:
        if not isinstance(params, PackedSeqParams):
            from packgraph.integrations.megatron import from_megatron

            params = from_megatron(params, validate=False)
        return params.attention_view()
    if kwargs.get("cu_seq_lens_q") is None:
        raise PackedSeqParamsError(
            "cu_seqlens_q",
            "no packing metadata reached the attention",
            "pass packed_seq_params=... or cu_seq_lens_q/cu_seq_lens_k with int max_length_q/max_length_k to the "
            "model (packed_forward does); position_ids alone would need a host sync to find the boundaries",
        )
    for name in ("max_length_q", "max_length_k"):
        if isinstance(kwargs.get(name), Tensor):
            raise PackedSeqParamsError(
                name,
                "must be a Python int (static)",
                "a tensor needs .item() (a host sync, which breaks CUDA graphs); build batches with "
                "from_flattening_batch(..., buckets=...) so max lengths are static bucket values",
            )
    params = PackedSeqParams.from_hf_kwargs(kwargs)
    changes = {}
    for name in ("cu_seqlens_q", "cu_seqlens_kv"):
        t = getattr(params, name)
        if t.dtype != torch.int32:  # a device-side cast: graph-safe, and FA2 wants int32 offsets
            changes[name] = t.to(torch.int32)
    return params.replace(**changes) if changes else params


register_packgraph_attention()


# ---------------------------------------------------------------------------------------------------- batches
def packed_forward(
    model: nn.Module, packed_batch: PackedBatch, *, compute_loss: bool = False, **model_kwargs: Any
) -> Any:
    """Run an HF causal LM on a ``PackedBatch`` (one ``[1, T]`` stream): no host sync, graph-friendly.

    The model gets ``input_ids`` and ``position_ids`` as ``[1, T]``, ``packed_seq_params`` and, when the layout is
    representable (no padded twins), HF's flash kwargs with the params' static max lengths, so the same call
    serves ``attn_implementation="packgraph"`` and ``"flash_attention_2"``.

    With ``compute_loss``, ``output.loss`` is the mean cross-entropy of ``packed_batch.labels`` (already
    shifted targets) weighted by ``loss_mask``, computed in float32 here rather than by HF's loss (which would
    shift the labels a second time).
    """
    params = packed_batch.packed_seq_params
    kwargs: dict[str, Any] = {"packed_seq_params": params, "use_cache": False}
    if params.cu_seqlens_q_padded is None and params.cu_seqlens_kv_padded is None:
        kwargs.update(params.to_hf_kwargs())
    kwargs.update(model_kwargs)
    out = model(input_ids=packed_batch.tokens.view(1, -1), position_ids=packed_batch.position_ids.view(1, -1), **kwargs)
    if compute_loss:
        out.loss = packed_loss(out.logits, packed_batch)
    return out


def packed_loss(logits: Tensor, packed_batch: PackedBatch) -> Tensor:
    """Mean next-token cross-entropy over the rows ``loss_mask`` selects (float32; no host sync)."""
    logits = logits.reshape(-1, logits.shape[-1]).float()
    labels = packed_batch.labels.reshape(-1)
    mask = packed_batch.loss_mask.reshape(-1).to(logits.dtype)
    per_row = nn.functional.cross_entropy(logits, labels.clamp_min(0), reduction="none")
    return (per_row * mask).sum() / mask.sum().clamp_min(1.0)


# ---------------------------------------------------------------------------------------------------- graphs
class _LayerCall(nn.Module):
    """Flat-tensor adapter a graph captures: ``(hidden_states, [cos, sin, packed_seq_params]) -> hidden_states``.

    It owns the target (layer, attention or MLP) as a child so that ``parameters()`` reaches its weights, and
    calls the target's *original* forward, since the target's ``forward`` is replaced by the graphed one.
    """

    def __init__(self, target: nn.Module, scope: str) -> None:
        super().__init__()
        self.target = target
        self.scope = scope
        self.original_forward = target.forward
        self.returns_tuple: bool | None = None
        self.tuple_len = 0

    def forward(self, hidden_states: Tensor, *rest: Any, **static: Any) -> Tensor:
        if self.scope == "mlp":
            out = self.original_forward(hidden_states)
        else:
            cos, sin, params = rest
            call = {"attention_mask": None, "position_embeddings": (cos, sin), "packed_seq_params": params}
            if self.scope == "layer":
                call["use_cache"] = False
            out = self.original_forward(hidden_states, **call, **static)
        self.returns_tuple = isinstance(out, tuple)
        self.tuple_len = len(out) if self.returns_tuple else 0
        return out[0] if self.returns_tuple else out


@dataclasses.dataclass
class GraphedDecoderLayers:
    """Handle returned by :func:`graph_decoder_layers`: the graphed callables, and ``remove()`` to undo.

    Also a context manager: leaving the ``with`` block restores the original forwards.
    """

    targets: list[nn.Module]
    adapters: list[_LayerCall]
    graphed: list[Callable[..., Tensor]]
    scope: str
    checkpointed: list[nn.Module] = dataclasses.field(default_factory=list)  # their recompute runs in the graphs

    def remove(self) -> None:
        """Restore every target's original forward (the graphs and their memory are released with them)."""
        for target in self.targets:
            if "forward" in target.__dict__:
                del target.forward
        for layer in self.checkpointed:
            layer.gradient_checkpointing = True
        self.graphed = []

    @contextlib.contextmanager
    def paused(self) -> Iterator[GraphedDecoderLayers]:
        """Within the block the targets run their original forwards, eagerly; the graphs are kept for after it.

        For work the graphs were not captured for (evaluation under ``no_grad`` in a training run, a one-off
        shape), which would otherwise capture graphs of its own.
        """
        patched = [target.__dict__.pop("forward", None) for target in self.targets]
        for layer in self.checkpointed:
            layer.gradient_checkpointing = True
        try:
            yield self
        finally:
            for target, forward in zip(self.targets, patched, strict=True):
                if forward is not None:
                    target.forward = forward
            for layer in self.checkpointed:
                layer.gradient_checkpointing = False

    def __enter__(self) -> GraphedDecoderLayers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def graph_decoder_layers(
    model: nn.Module,
    sample_batch: PackedBatch,
    *,
    scope: str = "layer",
    buckets: BucketPolicy | None = None,
    forward_only: bool = False,
    **capture_opts: Any,
) -> GraphedDecoderLayers:
    """Capture each decoder layer of an HF causal LM with ``packgraph.capture_layers``.

    The model must be loaded with ``attn_implementation="packgraph"`` and live on a CUDA device. Each target's
    ``forward`` is replaced in place (parameter names, ``state_dict`` and optimizers are untouched) by a call to its
    graph; embeddings, the rotary tables, the final norm, the head and the loss keep running eagerly. Graph inputs
    per call: the hidden states, the layer's rotary ``(cos, sin)`` and the packed params (their tensors are
    dynamic, ``max_seqlen``/capacity static, see ``PackedSeqParams.static_signature``).

    Args:
        model: e.g. ``LlamaForCausalLM``; its decoder is ``model.model`` (or ``model.base_model``, e.g. GPT-NeoX's
            ``model.gpt_neox``, or ``model`` itself) with ``.layers`` and ``.rotary_emb``.
        sample_batch: a fixed-shape ``PackedBatch`` (same ``T`` as the batches to come) used for capture.
        scope: ``"layer"`` (whole decoder layers), ``"attn"`` (``layer.self_attn``, GPT-NeoX's
            ``layer.attention``) or ``"mlp"`` (``layer.mlp`` only, an MoE block included; its only input is the
            hidden states). ``"attention"`` is a deprecated alias of ``"attn"`` (it warns with a ``FutureWarning``).
        buckets: a ``BucketPolicy`` for the capture cache (static metadata per bucket).
        forward_only: no-grad graphs for scoring and eval (call the model under ``torch.no_grad()``).
        capture_opts: passed to ``capture_layers`` (``num_warmup_iters``, ``on_mismatch``, ``max_graphs``, ...).

    Calls must come through :func:`packed_forward` (or pass ``packed_seq_params``/the flash kwargs yourself), with
    no attention mask and no KV cache.

    Mixture of experts: the attention of every MoE model is captured (``scope="attn"``; the MoE blocks stay
    eager). Whole layers and MoE blocks capture only when the experts read nothing on the host, which depends on
    transformers' ``experts_implementation``: ``"eager"`` never does (it loops over the experts found with
    ``nonzero``), ``"batched_mm"`` always does (it gathers each token's expert weights), ``"grouped_mm"`` (the
    default) where torch runs its fused grouped GEMM; a capture error says which. Router logits
    (``output_router_logits``) are recorded by hooks on the routers, which a replay does not run: refused with
    those scopes.

    Gradient checkpointing (``model.gradient_checkpointing_enable()``) recomputes inside the graphs: the layers are
    captured with ``recompute=True`` (their forward graphs save only their inputs; each backward graph runs its
    layer's forward again), and HF's own wrapper around each layer's call, which would replay the forward graph a
    second time and save nothing, is switched off while they are graphed (``remove()`` and ``paused()`` restore it).
    Dropout in such a layer is refused (its recomputation would draw other masks).

    CPU tests drive the real engine through its seam: ``with packgraph.graphs.use_recorder(stand_in): ...``.

    Raises:
        RuntimeError: no CUDA (the engine's error; run :func:`packed_forward` eagerly on the CPU). ValueError:
            wrong ``attn_implementation`` or ``scope``, or the model is not on the device the graphs are captured
            on. GraphCaptureError: a target reads device values on the host (for MoE experts, with what to do
            instead), or draws random numbers under gradient checkpointing.
    """
    from packgraph.graphs import capture_layers

    scope = _resolve_scope(scope)

    def make_graphed(adapters: list[_LayerCall], sample_args: tuple, recompute: bool) -> list[Callable[..., Tensor]]:
        # Whole layers feed each other directly (chained: no copies between graphs); with a partial scope an eager
        # half sits between two graphs, so each graph copies its input.
        opts = dict(capture_opts, forward_only=forward_only, chain=scope == "layer")
        opts.setdefault("recompute", recompute)
        if any(is_fsdp_unit(a.target) for a in adapters):
            # FSDP2 units as targets: their hooks run around the graphed forward installed on them, and the adapter
            # calls their original forward within (packgraph.graphs.capture, FSDP2)
            opts["inside_fsdp_units"] = True
        if buckets is not None:
            opts["buckets"] = buckets
        return capture_layers(adapters, sample_args, **opts)

    return _install(model, sample_batch, scope=scope, forward_only=forward_only, make_graphed=make_graphed)


def _install(
    model: nn.Module,
    sample_batch: Any,
    *,
    scope: str,
    forward_only: bool,
    make_graphed: Callable[[list[_LayerCall], tuple, bool], Sequence[Callable[..., Tensor]]],
) -> GraphedDecoderLayers:
    """Build adapters and sample inputs, let ``make_graphed`` capture them, and patch the targets' forwards."""
    scope = _resolve_scope(scope)
    attn_impl = getattr(model.config, "_attn_implementation", None)
    if attn_impl not in ATTENTION_NAMES:
        raise ValueError(
            f"the model runs attn_implementation={attn_impl!r}; load it with attn_implementation='packgraph' "
            "(or 'packgraph_doc_mask'; or call model.set_attn_implementation('packgraph'))"
        )
    decoder = _decoder(model)
    layers = list(decoder.layers)
    # Gradient checkpointing recomputes inside the graphs instead (capture_layers(recompute=True)): HF's own
    # wrapper, around each layer's call, would replay the forward graph a second time and save nothing.
    checkpointed = [layer for layer in layers if getattr(layer, "gradient_checkpointing", False)]
    targets = [
        {"layer": layer, "attn": _child(layer, *_ATTENTION_NAMES), "mlp": _child(layer, "mlp")}[scope]
        for layer in layers
    ]
    for target in targets:
        if "forward" in target.__dict__:
            raise RuntimeError(f"{type(target).__name__}.forward is already patched (graphed twice? call remove())")
    adapters = [_LayerCall(target, scope) for target in targets]
    for adapter in adapters:  # capture under the mode the model is in now (the flag is part of the signature)
        adapter.training = adapter.target.training
    # The first layer's input requires grad only when the embedding trains (a frozen one under LoRA does not).
    embedding = decoder.get_input_embeddings() if hasattr(decoder, "get_input_embeddings") else decoder.embed_tokens
    trains_embedding = any(p.requires_grad for p in embedding.parameters())
    sample_args = _sample_args(decoder, sample_batch, scope=scope, requires_grad=not forward_only and trains_embedding)
    try:
        graphed = list(make_graphed(adapters, sample_args, bool(checkpointed) and not forward_only))
    except GraphCaptureError as exc:
        experts = _experts_implementation(model)
        if scope == "attn" or experts is None:
            raise
        raise GraphCaptureError(f"{exc}\n{_moe_capture_hint(experts)}", exc.syncs, exc.location) from exc
    if len(graphed) != len(targets):
        raise RuntimeError(f"capture returned {len(graphed)} callables for {len(targets)} layers")
    for target, adapter, fn in zip(targets, adapters, graphed, strict=True):
        target.forward = _graphed_forward(adapter, fn)
    for layer in checkpointed:
        layer.gradient_checkpointing = False
    return GraphedDecoderLayers(
        targets=targets, adapters=adapters, graphed=graphed, scope=scope, checkpointed=checkpointed
    )


def _resolve_scope(scope: str, *, stacklevel: int = 3) -> str:
    """``scope`` as one of :data:`SCOPES`: a deprecated alias warns (one ``FutureWarning``) and is translated.

    Raises:
        ValueError: neither a scope nor an alias.
    """
    if scope in _SCOPE_ALIASES:
        current = _SCOPE_ALIASES[scope]
        warnings.warn(
            f"scope={scope!r} is deprecated and will be removed: use scope={current!r}",
            FutureWarning,
            stacklevel=stacklevel,
        )
        return current
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    return scope


def _graphed_forward(adapter: _LayerCall, graphed: Callable[..., Tensor]) -> Callable[..., Any]:
    """The replacement ``forward``: split the HF call into graph inputs, replay, restore HF's output structure."""
    scope = adapter.scope

    def forward(*args: Any, **kwargs: Any) -> Any:
        if args:
            hidden_states, args = args[0], args[1:]
        else:
            hidden_states = kwargs.pop("hidden_states")
        if scope != "attn" and "router_logits" in _recorded_outputs():
            raise ValueError(
                "output_router_logits=True: transformers records router logits with a forward hook on each router, "
                f"which a replay of graphed {scope!r} targets does not run. Graph scope='attn' (the MoE blocks stay "
                "eager) or leave output_router_logits off"
            )
        if scope == "mlp":
            if args or kwargs:
                raise TypeError(f"a graphed MLP takes only the hidden states, got extra arguments {sorted(kwargs)}")
            adapter.training = adapter.target.training
            out = graphed(hidden_states)
            # An MoE block may return (hidden_states, router_scores) (gpt-oss): the layer unpacks a tuple of that
            # length and keeps only the hidden states.
            return (out, *(None,) * (adapter.tuple_len - 1)) if adapter.returns_tuple else out
        if args:
            raise TypeError("a graphed decoder layer takes the hidden states positionally and the rest by keyword")
        if kwargs.pop("attention_mask", None) is not None:
            raise ValueError(
                "a graphed layer takes no attention mask (load the model with attn_implementation='packgraph')"
            )
        for name in _CACHE_KWARGS:
            if kwargs.pop(name, None) is not None:
                raise ValueError("a graphed layer cannot update a KV cache: call the model with use_cache=False")
        position_embeddings = kwargs.pop("position_embeddings", None)
        if position_embeddings is None:
            raise ValueError("the decoder must pass rotary position_embeddings=(cos, sin) to its layers")
        params = packed_params_from_kwargs(kwargs)
        static = {}
        for name, value in kwargs.items():
            if name in _IGNORED_LAYER_KWARGS or name == "packed_seq_params":
                continue
            if isinstance(value, Tensor):
                raise ValueError(f"tensor kwarg {name!r} cannot cross a graphed layer's boundary")
            static[name] = value  # non-tensor kwargs are static: part of the graph signature
        cos, sin = position_embeddings
        # The adapter is outside the model tree, so model.train()/eval() never reaches it; the graph signature
        # reads its flag, which must follow the target's.
        adapter.training = adapter.target.training
        out = graphed(hidden_states, cos, sin, params, **static)
        if scope == "attn":
            return out, None
        return (out,) if adapter.returns_tuple else out

    return forward


def _experts_implementation(model: nn.Module) -> str | None:
    """The model's transformers ``experts_implementation`` when it has experts that follow one, else None.

    Every transformers 5 config carries ``_experts_implementation`` (``"eager"`` on a dense model too); models whose
    experts dispatch on it report ``_can_set_experts_implementation()``.
    """
    can_set = getattr(model, "_can_set_experts_implementation", None)
    if not callable(can_set) or not can_set():
        return None
    return getattr(getattr(model, "config", None), "_experts_implementation", None)


def _moe_capture_hint(experts: str) -> str:
    """What to do when an MoE model's layers or MLPs could not be captured (appended to the capture error)."""
    return (
        f"  MoE: this model's experts run experts_implementation={experts!r}. 'eager' loops over the experts it "
        "finds with nonzero (a host read); 'grouped_mm' reads its group offsets on the host wherever torch falls back "
        "from its fused grouped GEMM (which takes bf16 inputs and weights on recent GPUs: under autocast, float32 "
        "weights fall back); 'batched_mm' reads nothing on the host but "
        "gathers each token's expert weights (memory grows with tokens x top-k x expert size). Load the model with "
        "experts_implementation='batched_mm' (or bf16 weights for 'grouped_mm'), or graph scope='attn', which "
        "captures the attention of every MoE model"
    )


def _recorded_outputs() -> set[str]:
    """The outputs transformers' forward hooks are collecting in the model call under way (``output_router_logits``
    and the like), read from its collector; empty when none is or transformers has no such collector."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - older transformers
        return set()
    collected = _active_collector.get()
    return set(collected) if isinstance(collected, dict) else set()


def _sample_args(decoder: nn.Module, sample_batch: Any, *, scope: str, requires_grad: bool) -> tuple:
    """Capture inputs shaped like a real call: hidden states from the embedding, rotary tables, the params."""
    device = next(decoder.parameters()).device
    batch = sample_batch.to(device)
    with torch.no_grad():
        embed = decoder.get_input_embeddings() if hasattr(decoder, "get_input_embeddings") else decoder.embed_tokens
        weight = embed.weight
        if is_dtensor(weight):
            # FSDP2 gathers the embedding only inside the root's forward; a capture depends on shapes, not values
            hidden = torch.zeros(1, batch.tokens.numel(), weight.shape[-1], dtype=weight.dtype, device=device)
        else:
            hidden = embed(batch.tokens.view(1, -1))
        if not hasattr(decoder, "rotary_emb"):
            raise ValueError(f"{type(decoder).__name__} has no rotary_emb: only RoPE decoders are supported")
        rotary = {}
        layer_types = getattr(getattr(decoder, "config", None), "layer_types", None)
        if layer_types and "layer_type" in inspect.signature(decoder.rotary_emb.forward).parameters:
            # Gemma 3: one table per layer type, all of one shape (only shapes matter for the sample).
            rotary["layer_type"] = layer_types[0]
        cos, sin = decoder.rotary_emb(hidden, position_ids=batch.position_ids.view(1, -1), **rotary)
    hidden = hidden.detach().requires_grad_(requires_grad)
    if scope == "mlp":
        return (hidden,)
    return (hidden, cos, sin, batch.packed_seq_params.attention_view())


def _decoder(model: nn.Module) -> nn.Module:
    # get_decoder(): transformers' own accessor, which a PEFT model forwards to the model it wraps; base_model: the
    # decoder under its own prefix (GPT-NeoX's model.gpt_neox).
    get_decoder = getattr(model, "get_decoder", None)
    first = get_decoder() if callable(get_decoder) else None
    for candidate in (first, getattr(model, "model", None), getattr(model, "base_model", None), model):
        if candidate is not None and isinstance(getattr(candidate, "layers", None), nn.ModuleList):
            return candidate
    raise ValueError(f"{type(model).__name__}: no decoder with a .layers ModuleList (expected model.model.layers)")


def _child(layer: nn.Module, *names: str) -> nn.Module:
    """The first of ``names`` that is a submodule of ``layer``."""
    for name in names:
        child = getattr(layer, name, None)
        if isinstance(child, nn.Module):
            return child
    raise ValueError(f"{type(layer).__name__} has no {' or '.join(map(repr, names))} submodule to graph")
