"""Megatron-Core: packed THD batches through Megatron's own layers, under packgraph graphs.

Three pieces:

* **Conversion** (:mod:`.convert`, no Megatron needed except for :func:`to_megatron`): :func:`from_megatron`,
  :func:`to_megatron`, :func:`megatron_rl_bin_params`, :func:`megatron_packed_seq_params_class`. When Megatron-Core
  is importable, importing this package registers Megatron's ``PackedSeqParams`` with the graph engine
  (:func:`packgraph.params.register_params_type`), so ``capture``/``capture_layers`` split it like packgraph's own.
* **The layer spec** (:mod:`.spec`): :func:`get_gpt_layer_packgraph_spec`, a ``ModuleSpec`` like Megatron's
  ``get_gpt_layer_local_spec`` whose core attention runs :func:`packgraph.ops.varlen_attention` on THD input and
  whose THD rotary embedding never reads offsets on the host.
* **Graphs** (:mod:`.layers`): :func:`graph_transformer_layers` captures every ``TransformerLayer`` of a
  ``GPTModel`` (or of a hybrid model's stack, Mamba layers left eager) in one capture group.

The spec and the graphs import Megatron-Core on first use: ``from packgraph.integrations.megatron import
get_gpt_layer_packgraph_spec`` raises ``ImportError`` with the install line when it is missing.
"""

from __future__ import annotations

from typing import Any

from packgraph.integrations.megatron.convert import (
    from_megatron,
    megatron_packed_seq_params_class,
    megatron_rl_bin_params,
    to_megatron,
)
from packgraph.params import register_params_type

__all__ = [
    "GraphedTransformerLayers",
    "PackgraphDotProductAttention",
    "PackgraphSelfAttention",
    "from_megatron",
    "get_gpt_layer_packgraph_spec",
    "graph_transformer_layers",
    "megatron_packed_seq_params_class",
    "megatron_rl_bin_params",
    "to_megatron",
]

# Names that need Megatron-Core at import, loaded on first access (PEP 562) so conversion works without it.
_LAZY = {
    "get_gpt_layer_packgraph_spec": "spec",
    "PackgraphDotProductAttention": "spec",
    "PackgraphSelfAttention": "spec",
    "graph_transformer_layers": "layers",
    "GraphedTransformerLayers": "layers",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    megatron_packed_seq_params_class()  # ImportError with the install line when Megatron-Core is missing
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def _register_with_engine() -> None:
    try:
        cls = megatron_packed_seq_params_class()
    except ImportError:
        return
    register_params_type(cls, to_packgraph=lambda obj: from_megatron(obj, validate=False), from_packgraph=to_megatron)


_register_with_engine()
