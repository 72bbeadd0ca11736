"""Capture the ``TransformerLayer``s of a Megatron-Core model into packgraph graphs, in one capture group.

:func:`graph_transformer_layers` is the counterpart of Megatron's ``TECudaGraphHelper`` for packed THD batches,
seeded by a sample ``PackedSeqParams``. It replaces each target's ``forward`` in place (parameters, ``state_dict``
and optimizers are untouched) by a call to its graph, captured with one :func:`packgraph.capture_layers` call: one
capture group (one memory pool; each layer's signature cache as the engine sizes it). Everything outside the
targets stays eager: the embedding, the rotary table, the final norm, the output layer and loss, and every layer
that is not a ``TransformerLayer`` (a hybrid model's Mamba layers, whose ``seq_idx``/``total_tokens`` never enter
a graph).

What crosses a graph boundary on each call: the hidden states ``[T, 1, hidden]``, the rotary table (padded on the
device to ``T`` rows, so its shape is static whatever ``max_seqlen`` the caller's params have; rows past the
caller's table are never read by a real token) and the packed params. Their ``cu_seqlens*`` tensors are graph
inputs; the static metadata (``max_seqlen``, capacity, ``qkv_format``) is the signature, bucketed by ``buckets``.
Megatron's ``PackedSeqParams`` is converted to packgraph's at the boundary (tensors shared, nothing copied, no
sync; once per params object, not per layer) and back to Megatron's class inside the graph.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from packgraph.buckets import BucketPolicy
from packgraph.graphs import capture_layers
from packgraph.integrations.megatron.convert import from_megatron, to_megatron
from packgraph.params import PackedSeqParams, PackedSeqParamsError

try:
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.transformer_layer import TransformerLayer
except ImportError as exc:  # pragma: no cover - exercised only without Megatron-Core
    raise ImportError("graph_transformer_layers needs Megatron-Core: pip install 'megatron-core>=0.16'") from exc

__all__ = ["SCOPES", "GraphedTransformerLayers", "graph_transformer_layers"]

SCOPES: tuple[str, ...] = ("layer", "attn", "mlp")
"""What runs under a graph: whole ``TransformerLayer``s, their ``self_attention`` only, or their ``mlp`` only."""

_CARRIED = ("rotary_pos_emb", "packed_seq_params")  # the arguments a graph takes besides the hidden states


class _GraphedCall(nn.Module):
    """What one graph runs: its target called the way Megatron calls it, returning one tensor.

    It owns the target as a child (so ``parameters()`` reaches its weights) and calls the target's *original*
    forward, since the target's ``forward`` is replaced by the graphed one. The params arrive as packgraph's
    (rebuilt on the graph's static buffers) and reach the target as Megatron's class. The target's second output
    (a layer's cross-attention context, an attention's or MLP's skipped bias) must be ``None`` or one of its
    parameters; :meth:`second` gives it back at call time. It is recorded by name: the engine may hold proxies
    in the parameters' places while it captures, and the eager code after the graph must see the real parameter.
    """

    def __init__(self, target: nn.Module, scope: str) -> None:
        super().__init__()
        self.target = target
        self.scope = scope
        self.original_forward = target.forward
        self.second_name: str | None = None

    def forward(self, hidden_states: Tensor, *carried: Any) -> Tensor:
        if self.scope == "mlp":
            out = self.original_forward(hidden_states)
        else:
            rotary_pos_emb, params = carried
            out = self.original_forward(
                hidden_states, attention_mask=None, rotary_pos_emb=rotary_pos_emb, packed_seq_params=to_megatron(params)
            )
        main, second = out if isinstance(out, tuple) else (out, None)
        self.second_name = self._name_of_second(second)
        return main

    def second(self) -> Tensor | None:
        """The target's second output, as the eager target would return it now."""
        return None if self.second_name is None else self.target.get_parameter(self.second_name)

    def _name_of_second(self, second: Any) -> str | None:
        if second is None:
            return None
        for name, p in self.target.named_parameters():
            if second is p:
                return name
        what = "cross-attention context" if self.scope == "layer" else "computed bias"
        raise ValueError(
            f"graph_transformer_layers: {type(self.target).__name__} returned a {what} a graph cannot pass on; "
            f"graph a scope that returns one tensor (scopes: {SCOPES})"
        )


@dataclasses.dataclass
class GraphedTransformerLayers:
    """Returned by :func:`graph_transformer_layers`: the patched ``targets``, their ``graphed`` callables, ``scope``.

    ``remove()`` (or leaving a ``with`` block) restores the original forwards and drops the graphs.
    """

    targets: list[nn.Module]
    adapters: list[_GraphedCall]
    graphed: list[Any]
    scope: str
    rows: int
    # With full recomputation: the decoder block and its own config, given back by remove()
    block_config: tuple[nn.Module, Any] | None = None

    def remove(self) -> None:
        """Restore every target's original forward (the graphs and their memory go with the callables), and the
        decoder block's recomputation."""
        for target in self.targets:
            if "forward" in target.__dict__:
                del target.forward
        if self.block_config is not None:
            block, config = self.block_config
            block.config = config
            self.block_config = None
        self.graphed = []

    @property
    def captures(self) -> int:
        """Graphs captured so far, over every target and signature."""
        return sum(g.captures for g in self.graphed)

    @property
    def num_signatures(self) -> int:
        """Distinct signatures (buckets) held by the first target's cache."""
        return self.graphed[0].num_graphs if self.graphed else 0

    def __enter__(self) -> GraphedTransformerLayers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def graph_transformer_layers(
    model: nn.Module,
    sample_packed_seq_params: Any,
    *,
    scope: str = "layer",
    buckets: BucketPolicy | None = None,
    total_tokens: int | None = None,
    **capture_options: Any,
) -> GraphedTransformerLayers:
    """Capture every ``TransformerLayer`` of a Megatron ``GPTModel`` (or hybrid model) through one capture group.

    The model must be built with :func:`~packgraph.integrations.megatron.get_gpt_layer_packgraph_spec` (or
    another spec whose layers run THD input without host syncs) and live on a CUDA device; its layers are found
    at ``model.decoder.layers`` (wrappers with ``.module`` are unwrapped). Calls must be packed: the model's
    ``forward(input_ids, position_ids, attention_mask=None, packed_seq_params=...)`` with ``T`` rows.

    Args:
        model: a ``GPTModel``, a ``HybridModel``/``MambaModel`` (its non-``TransformerLayer`` layers stay eager),
            or a wrapper of one.
        sample_packed_seq_params: a representative ``PackedSeqParams`` (Megatron's or packgraph's, e.g.
            :func:`~packgraph.integrations.megatron.megatron_rl_bin_params`) on the model's device: the signature
            captured first.
        scope: ``"layer"`` (whole layers, chained: no copies between graphs when nothing eager sits between two
            of them), ``"attn"`` (``layer.self_attention``; norms, residuals and the MLP eager, Megatron's
            ``cuda_graph_modules=[attn]``) or ``"mlp"`` (``layer.mlp``).
        buckets: a ``BucketPolicy`` (e.g. ``packgraph.default_buckets(T)``): each call's params are re-padded to
            their bucket before the signature is taken.
        total_tokens: the rows ``T`` of the packed batches; default the sample's ``total_tokens``, else its last
            layout offset (Megatron-Core 0.16's class has no ``total_tokens``: pass it when batches have a dead
            tail). A call with another ``T`` is another signature, captured when it comes.
        capture_options: passed to ``capture_layers`` (``num_warmup_iters``, ``on_mismatch``, ``max_graphs``,
            ``forward_only``, ``validate``, ...).

    Returns:
        a :class:`GraphedTransformerLayers` handle; ``.remove()`` undoes it.

    Full activation recomputation (``recompute_granularity="full"``) runs inside the graphs: the layers are
    captured with ``recompute=True`` (each forward graph keeps only its inputs, each backward graph recomputes the
    layer's forward first), and the decoder block, which would otherwise re-run groups of layers in the backward
    outside their graphs, runs them plainly until ``remove()``. The grads are those of Megatron's recomputation;
    the memory is that of one layer recomputed at a time (``recompute_method="uniform"``, one layer per group).

    Raises:
        ValueError: unknown scope, no layers, layers already graphed. NotImplementedError: selective
            recomputation, Megatron's own CUDA graphs on, ``gradient_accumulation_fusion``, context parallel
            size > 1.
    """
    if scope not in SCOPES:
        raise ValueError(f"graph_transformer_layers: scope must be one of {SCOPES}, got {scope!r}")
    model = _unwrap(model)
    layers = list(model.decoder.layers)
    _check_model(model, layers)
    targets = _targets(layers, scope)
    if not targets:
        raise ValueError(f"graph_transformer_layers: {type(model).__name__} has no TransformerLayer to graph")
    full = _sample_params(sample_packed_seq_params)
    stream_rows = _rows(full, total_tokens)  # before attention_view(), which drops total_tokens
    params = full.attention_view()
    boundary = _Boundary(stream_rows, _sequence_shards(model))
    rows = boundary.hidden_rows
    adapters = [_GraphedCall(target, scope) for target in targets]
    for adapter in adapters:  # captured under the mode the model is in now (the flag is in the signature)
        adapter.training = adapter.target.training
    device = next(model.parameters()).device
    dtype = _hidden_dtype(model)
    hidden = torch.randn(
        rows, 1, model.config.hidden_size, generator=torch.Generator(device).manual_seed(0), device=device, dtype=dtype
    ).requires_grad_(not capture_options.get("forward_only", False))
    handle = GraphedTransformerLayers(targets=targets, adapters=adapters, graphed=[], scope=scope, rows=stream_rows)
    sample = (hidden,) if scope == "mlp" else (hidden, boundary.rotary(_sample_rotary(model, stream_rows)), params)
    opts = dict(capture_options, chain=scope == "layer" and len(targets) == len(layers))
    if buckets is not None:
        opts["buckets"] = buckets
    full = model.config.recompute_granularity == "full"
    if full:
        if scope != "layer" or opts.get("recompute") is False:
            raise NotImplementedError(
                "graph_transformer_layers: recompute_granularity='full' recomputes whole layers: graph them with "
                f"scope='layer' and recompute (not scope={scope!r}, recompute={opts.get('recompute')!r}); the block "
                "would otherwise re-run graphed layers outside their graphs"
            )
        opts["recompute"] = True
    handle.graphed = list(capture_layers(adapters, sample, **opts))
    if full:
        # The block's own recomputation would re-run the graphed layers outside their graphs: it sees a copy of
        # the config without it (the layers keep theirs).
        block = model.decoder
        plain = copy.copy(block.config)
        plain.recompute_granularity = None
        handle.block_config = (block, block.config)
        block.config = plain
    for target, adapter, graphed in zip(targets, adapters, handle.graphed, strict=True):
        target.forward = _graphed_forward(adapter, graphed, boundary)
    return handle


class _Boundary:
    """Per-call work at the graph boundary, done once per object rather than once per layer.

    * the rotary table padded to the stream's ``rows`` (a static shape; positions stay below it), cached for the
      table object GPTModel passes (its ``RotaryEmbedding`` caches tables per length, so one object serves a run
      of same-bucket batches);
    * Megatron params converted to packgraph's, cached for the params object the decoder passes to every layer.

    With sequence parallelism each rank's hidden states hold ``rows / shards`` of the stream's rows.
    """

    def __init__(self, rows: int, shards: int = 1) -> None:
        self.shards = shards
        self.rows = rows
        self._rotary: tuple[Any, Any] = (None, None)
        self._params: tuple[Any, Any] = (None, None)

    @property
    def hidden_rows(self) -> int:
        return self.rows // self.shards

    def follow(self, hidden_rows: int) -> None:
        """A call with another ``T`` (a new signature, captured when it comes): pad rotary tables to it."""
        if hidden_rows != self.hidden_rows:
            self.rows = hidden_rows * self.shards
            self._rotary = (None, None)

    def rotary(self, table: Tensor | None) -> Tensor | None:
        if table is None:
            return None
        if self._rotary[0] is table:
            return self._rotary[1]
        if isinstance(table, tuple):
            raise NotImplementedError("graph_transformer_layers: separate query/key rotary tables are not supported")
        n = table.shape[0]
        if n >= self.rows:
            padded = table[: self.rows]
        else:
            # Rows past the caller's table are positions no real token has (its length bounds max_seqlen).
            padded = torch.cat([table, table.new_zeros((self.rows - n, *table.shape[1:]))])
        self._rotary = (table, padded)
        return padded

    def params(self, params: Any) -> PackedSeqParams:
        if isinstance(params, PackedSeqParams):
            return params
        source, converted = self._params
        if source is params and _same_fields(params, converted):
            return converted
        converted = from_megatron(params, validate=False)
        self._params = (params, converted)
        return converted


def _same_fields(theirs: Any, ours: PackedSeqParams) -> bool:
    names = [f.name for f in dataclasses.fields(theirs) if hasattr(ours, f.name)]
    return all(getattr(theirs, name) is getattr(ours, name) for name in names)


def _graphed_forward(adapter: _GraphedCall, graphed: Any, boundary: _Boundary) -> Any:
    """The replacement ``forward``: Megatron's call in, graph replay, Megatron's ``(output, second)`` out."""
    scope = adapter.scope
    who = type(adapter.target).__name__

    def forward(*args: Any, **kwargs: Any) -> Any:
        hidden_states = args[0] if args else kwargs.pop("hidden_states")
        if len(args) > 1:
            raise TypeError(f"a graphed {who} takes the hidden states positionally and the rest by keyword")
        carried = {name: kwargs.pop(name, None) for name in _CARRIED}
        _refuse_extra(who, kwargs)
        adapter.training = adapter.target.training  # the adapter is outside the model tree: follow the target
        if scope == "mlp":
            return graphed(hidden_states), adapter.second()
        params = carried["packed_seq_params"]
        if params is None or getattr(params, "qkv_format", None) != "thd":
            raise ValueError(
                f"a graphed {who} runs packed THD batches: pass packed_seq_params with qkv_format='thd' "
                "(call .remove() on the graph_transformer_layers handle to run other batches)"
            )
        boundary.follow(hidden_states.shape[0])
        rotary = boundary.rotary(carried["rotary_pos_emb"])
        return graphed(hidden_states, rotary, boundary.params(params)), adapter.second()

    return forward


def _refuse_extra(who: str, kwargs: dict) -> None:
    for name, value in kwargs.items():
        if value is None or value is False:
            continue
        if name == "attention_mask":
            raise ValueError(f"a graphed {who} takes attention_mask=None: packed THD batches are masked by cu_seqlens")
        raise ValueError(
            f"a graphed {who} cannot take {name}={type(value).__name__}: only the hidden states, rotary_pos_emb and "
            "packed_seq_params cross its graph (no inference context, cross-attention or padding mask)"
        )


# ---------------------------------------------------------------------------------------------------- model checks
def _unwrap(model: nn.Module) -> nn.Module:
    while not hasattr(model, "decoder") and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    if not isinstance(getattr(getattr(model, "decoder", None), "layers", None), nn.ModuleList):
        raise ValueError(f"graph_transformer_layers: {type(model).__name__} has no decoder.layers ModuleList")
    return model


def _check_model(model: nn.Module, layers: Sequence[nn.Module]) -> None:
    config = model.config
    if getattr(config, "recompute_granularity", None) not in (None, "full"):
        raise NotImplementedError(
            f"graph_transformer_layers: recompute_granularity={config.recompute_granularity!r} checkpoints parts of "
            "a layer with Megatron's RNG-tracking checkpoint, which a graph cannot capture; use 'full' (each graphed "
            "layer then recomputes inside its backward graph) or None"
        )
    impl = getattr(config, "cuda_graph_impl", "none")
    if getattr(config, "enable_cuda_graph", False) or impl not in (None, "none"):
        raise NotImplementedError(
            f"graph_transformer_layers: Megatron's own CUDA graphs are on (cuda_graph_impl={impl!r}, "
            f"enable_cuda_graph={getattr(config, 'enable_cuda_graph', False)}); turn them off to use packgraph's"
        )
    if getattr(config, "gradient_accumulation_fusion", False):
        # The fused wgrad GEMM adds into param.main_grad inside the layer's backward, so inside the graph: it
        # reads main_grad off the parameter the capture runs on (the engine's proxy, which has none), adds into
        # the real buffer at every warm-up, and sets grad_added_to_main_grad, a Python flag no replay sets again.
        raise NotImplementedError(
            "graph_transformer_layers: gradient_accumulation_fusion=True adds weight grads into main_grad inside "
            "the graphed backward, which the graphs do not support; set it to False (Megatron's "
            "DistributedDataParallel then adds the grads into main_grad from its hooks)"
        )
    cp = getattr(config, "context_parallel_size", 1) or 1
    if cp > 1:
        raise NotImplementedError(f"graph_transformer_layers: context_parallel_size={cp} is not supported")
    for layer in layers:
        for module in (layer, getattr(layer, "self_attention", None), getattr(layer, "mlp", None)):
            if module is not None and "forward" in module.__dict__:
                raise ValueError(
                    f"graph_transformer_layers: {type(module).__name__}.forward is already replaced (graphed "
                    "twice? call .remove() on the first handle)"
                )


def _targets(layers: Sequence[nn.Module], scope: str) -> list[nn.Module]:
    chosen = [layer for layer in layers if isinstance(layer, TransformerLayer)]
    if scope == "layer":
        return chosen
    name = "self_attention" if scope == "attn" else "mlp"
    parts = [getattr(layer, name, None) for layer in chosen]
    return [p for p in parts if isinstance(p, nn.Module) and not isinstance(p, (IdentityOp, IdentityFuncOp))]


def _sample_params(sample: Any) -> PackedSeqParams:
    params = sample if isinstance(sample, PackedSeqParams) else from_megatron(sample)
    if params.qkv_format != "thd":
        raise PackedSeqParamsError("qkv_format", "graph_transformer_layers needs a 'thd' sample")
    return params


def _rows(params: PackedSeqParams, total_tokens: int | None) -> int:
    rows = total_tokens if total_tokens is not None else params.total_tokens
    if rows is None:
        name = "cu_seqlens_q_padded" if params.cu_seqlens_q_padded is not None else "cu_seqlens_q"
        host = params.current_host_offsets()
        # Capture is setup: one device read here is acceptable (the replays never read offsets on the host).
        rows = host[name][-1] if host is not None and name in host else int(getattr(params, name)[-1])
    return rows


def _sequence_shards(model: nn.Module) -> int:
    """How many ranks split the hidden states' rows between layers (sequence parallelism), else 1."""
    config = model.config
    return config.tensor_model_parallel_size if getattr(config, "sequence_parallel", False) else 1


def _hidden_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the hidden states between layers: the embedding's output (fp32 with
    ``fp32_residual_connection``), else the config's ``params_dtype`` (a pipeline stage without embedding)."""
    if getattr(model.config, "fp32_residual_connection", False):
        return torch.float32
    embedding = getattr(getattr(model, "embedding", None), "word_embeddings", None)
    weight = getattr(embedding, "weight", None)
    return weight.dtype if isinstance(weight, Tensor) else model.config.params_dtype


def _sample_rotary(model: nn.Module, rows: int) -> Tensor | None:
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None:
        return None
    try:
        table = rope(rows, packed_seq=True)
    except TypeError as exc:
        raise NotImplementedError(
            f"graph_transformer_layers: {type(rope).__name__} is not a length-indexed rotary table (mRoPE takes "
            "position ids); only RotaryEmbedding and YaRN are supported"
        ) from exc
    return table[0] if isinstance(table, tuple) else table
