"""packgraph: packed variable-length sequences (THD) under CUDA graphs, forward and backward, equal to eager.

The public API:

* the contract: :class:`PackedSeqParams`, :class:`PackedSeqParamsError`, :class:`StaticSignature`;
* data: :func:`pack_sequences`, :class:`PackedBatch`, :func:`fixed_shape_sample`, :class:`BucketPolicy`;
* the attention backend, measured on the device: :func:`choose_attention_backend`;
* graphs: :func:`capture`, :func:`capture_layers`, :class:`GraphSignatureError`, :func:`find_host_syncs`;
* ops (graph-safe): ``packgraph.ops.varlen_attention``, ``packgraph.ops.apply_rope_thd``;
* the reference model: ``packgraph.models.GPT`` and ``GPTConfig``.

Integrations (``packgraph.integrations.hf``, ``.megatron``) and ``packgraph.distributed`` are imported on demand.
"""

from packgraph.backend_choice import BackendChoice, choose_attention_backend
from packgraph.buckets import Bucket, BucketPolicy, default_buckets, document_mask_buckets
from packgraph.graphs import (
    GraphCaptureError,
    GraphedCallable,
    GraphSignatureError,
    HostSync,
    capture,
    capture_layers,
    find_host_syncs,
)
from packgraph.ops import apply_rope_thd, varlen_attention
from packgraph.packing import PackedBatch, Packing, batches_from_corpus, fixed_shape_sample, pack_sequences
from packgraph.params import PackedSeqParams, PackedSeqParamsError, StaticSignature

__all__ = [
    "BackendChoice",
    "Bucket",
    "BucketPolicy",
    "GraphCaptureError",
    "GraphSignatureError",
    "GraphedCallable",
    "HostSync",
    "PackedBatch",
    "PackedSeqParams",
    "PackedSeqParamsError",
    "Packing",
    "StaticSignature",
    "apply_rope_thd",
    "batches_from_corpus",
    "capture",
    "capture_layers",
    "choose_attention_backend",
    "default_buckets",
    "document_mask_buckets",
    "find_host_syncs",
    "fixed_shape_sample",
    "pack_sequences",
    "varlen_attention",
]
__version__ = "0.1.0"
