"""The training-step methods ``packgraph bench`` compares (:mod:`packgraph.bench.measure` measures them).

Every method runs a full training step of the same :class:`~packgraph.models.gpt.GPT` (same seed, same weights):
forward, backward, ``AdamW.step()``, ``zero_grad(set_to_none=True)``; bf16 autocast on CUDA, float32 on CPU.
All of them consume the same stream of documents (:mod:`packgraph.bench.data`); they differ in what they feed
the model and what runs it:

===========================  ===============================================================================
``eager``                    exact ``cu_seqlens`` (capacity = documents) and the true ``max_seqlen``
``packgraph``                ``model.graphed(scope="layer")`` (``capture_layers``), default buckets
``packgraph-model``          ``model.graphed(scope="model")``: forward and backward of the whole loss, bucketed
``packgraph-docmask``        ``packgraph`` on the document-mask attention backend (FlexAttention, compiled), with
                             ``document_mask_buckets(T)``: one graph set for every batch
``packgraph-docmask-model+compile``  ``packgraph-model+compile`` on the document-mask backend: the model's graph
                             breaks once, where the mask is built; the attention is traced into the graph
``packgraph+compile``        each block ``torch.compile`` d (``mode="default"``, fusion), then captured by packgraph
``packgraph-model+compile``  the whole model ``torch.compile`` d (``mode="default"``), captured with scope
                             ``"model"``: compile-RO's fusion (embedding, head and loss too) with packgraph's graphs
``compile``                  ``torch.compile(model)``, fed the bucketed (fixed-shape) batches
``compile-ro``               ``torch.compile(model, mode="reduce-overhead")`` with ``cudagraph_mark_step_begin()``,
                             fed the bucketed batches
``compile-ro-raw``           the same, fed the raw exact batches: every new (capacity, max_seqlen) may re-record
``padded``                   no packing: documents right-padded to the batch max, ``[B, L]``, SDPA causal
``padded-mask``              the same with an explicit causal & key-padding boolean mask (SDPA's masked kernel)
``eager-ddp``                ``eager`` inside torch DDP (``summing_ddp``) on a process group of this one process
``packgraph-ddp``            ``packgraph`` inside torch DDP (the same group)
``packgraph-allreduce``      ``packgraph``, then packgraph's explicit all-reduce of the grads after backward
===========================  ===============================================================================

The three data-parallel methods run with world size 1 (the bench is one process): they measure what each engine
adds to a step (DDP's bucket copies and hooks, one all-reduce per bucket; the explicit path's flatten, all-reduce
and copy back), not scaling. They join a process group of one if none exists.

Why ``padded`` needs no mask: :mod:`packgraph.bench.padded`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Hashable
from typing import Any

import torch
import torch._dynamo
from torch import Tensor
from torch._dynamo.utils import counters

from packgraph.bench.padded import PaddedBatch, padded_batch, padded_loss
from packgraph.buckets import BucketPolicy, document_mask_buckets
from packgraph.models.gpt import GPT
from packgraph.packing import PackedBatch

__all__ = [
    "ALL_METHODS",
    "CUDA_ONLY_METHODS",
    "DP_METHODS",
    "METHODS",
    "Method",
    "cudagraph_records",
    "make_method",
]

METHODS: tuple[str, ...] = (
    "eager",
    "padded",
    "packgraph",
    "packgraph-model",
    "compile-ro",
    "compile-ro-raw",
    "compile",
    "packgraph+compile",
    "packgraph-model+compile",
)
"""The default method list of a full run, in run order: the fast ones first, so a run cut short by a time limit
still has the comparisons that matter most."""

DP_METHODS: tuple[str, ...] = ("eager-ddp", "packgraph-ddp", "packgraph-allreduce")
ALL_METHODS: tuple[str, ...] = (
    *METHODS,
    "padded-mask",
    "packgraph-docmask",
    "packgraph-docmask-model+compile",
    *DP_METHODS,
)
CUDA_ONLY_METHODS: frozenset[str] = frozenset(
    {
        "packgraph",
        "packgraph-model",
        "packgraph-docmask",
        "packgraph-docmask-model+compile",
        "packgraph+compile",
        "packgraph-model+compile",
        "compile-ro",
        "compile-ro-raw",
        "packgraph-ddp",
        "packgraph-allreduce",
    }
)


def _adamw(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    kwargs: dict[str, Any] = dict(lr=1e-4, weight_decay=0.1)
    if device.type == "cuda":
        kwargs["fused"] = True  # the fastest eager optimizer: the same for every method
    return torch.optim.AdamW(model.parameters(), **kwargs)


def _exact_key(batch: PackedBatch) -> tuple[int, int]:
    return len(batch.doc_lengths), max(batch.doc_lengths, default=0)


class Method:
    """One way to run a training step. Subclasses change :meth:`prepare` (host batch -> device input) and
    :meth:`loss`; :meth:`step` is the same full step for all."""

    name = "eager"
    warm_pool = False  # warm up over every timed batch (methods with a per-signature cache)
    counts_graphs = False  # run the graph-count phase over varied batches

    def __init__(self, model: GPT, policy: BucketPolicy, device: torch.device) -> None:
        self.model, self.policy, self.device = model, policy, device
        self.opt = _adamw(model, device)
        self.last_loss: Tensor | None = None
        self._dynamo_graphs0 = _dynamo_graphs()

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def prepare(self, batch: PackedBatch) -> Any:
        return batch.to(self.device)

    def signature(self, batch: PackedBatch) -> Hashable | None:
        """The host-side key a graph/compile cache would see for ``batch`` (None: no cache)."""
        return None

    def bucket_key(self, batch: PackedBatch) -> Hashable:
        """The default-bucket key of ``batch``: what a bucketed method's cache is keyed by."""
        return self.policy.bucket_for(max(batch.doc_lengths, default=0), len(batch.doc_lengths))

    def loss(self, inp: Any) -> Tensor:
        return self.model(inp.tokens, inp.packed_seq_params, inp.labels, inp.loss_mask)[1]

    def step(self, inp: Any) -> None:
        with self.autocast():
            loss = self.loss(inp)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.last_loss = loss.detach()

    def graphs(self) -> int | None:
        return None

    def recompiles(self) -> int | None:
        return None

    def extra(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class GraphedMethod(Method):
    name = "packgraph"
    warm_pool = True
    counts_graphs = True
    scope = "layer"
    compiles: str | None = None  # "blocks": each block torch.compile d; "model": the whole model

    def __init__(self, model: GPT, policy: BucketPolicy, device: torch.device) -> None:
        if self.compiles is not None:
            torch._dynamo.reset()
        if self.compiles == "blocks":
            # Replacing the block by its OptimizedModule makes both ``block(...)`` and ``block.forward(...)``
            # compiled, whichever the engine calls; the engine's warm-up iterations run the compilation, so
            # the capture records inductor's fused kernels.
            for i, block in enumerate(model.blocks):
                model.blocks[i] = torch.compile(block, mode="default")
        elif self.compiles == "model":
            # ``model(...)`` (which scope "model" captures) now runs the compiled whole loss: embedding, blocks,
            # head and cross-entropy fused by inductor, as compile-RO's graph has them.
            model.compile(mode="default")
        super().__init__(model, policy, device)
        self.graphed = model.graphed(scope=self.scope, buckets=policy)

    def signature(self, batch: PackedBatch) -> Hashable:
        return self.bucket_key(batch)

    def loss(self, inp: PackedBatch) -> Tensor:
        return self.graphed(inp)[1]

    def _counts(self) -> tuple[int, int]:
        """``(signatures, captures)``: distinct signatures recorded (each graphs every layer, fwd+bwd) and the
        per-callable captures summed over layers."""
        return int(self.graphed.captures), sum(int(g.captures) for g in self.graphed.callables)

    def graphs(self) -> int:
        return self._counts()[0]

    def recompiles(self) -> int | None:
        return _dynamo_graphs() - self._dynamo_graphs0 if self.compiles is not None else None

    def extra(self) -> dict[str, Any]:
        return {
            "graph_sets": int(self.graphed.captures),
            "callable_captures": self._counts()[1],
            "recaptures": int(self.graphed.recaptures),
            "evictions": sum(int(g.evictions) for g in self.graphed.callables),
        }

    def close(self) -> None:
        self.graphed = None
        if self.compiles is not None:
            torch._dynamo.reset()


class GraphedDocMaskMethod(GraphedMethod):
    name = "packgraph-docmask"

    def __init__(self, model: GPT, policy: BucketPolicy, device: torch.device) -> None:
        for block in model.blocks:
            block.attn.backend = "doc_mask"
        # the default policy's top max_seqlen rung is T: one bucket of T rows and T slots
        super().__init__(model, document_mask_buckets(policy.max_seqlen), device)


class GraphedDocMaskModelCompiledMethod(GraphedDocMaskMethod):
    name = "packgraph-docmask-model+compile"
    scope = "model"
    compiles = "model"


class GraphedModelMethod(GraphedMethod):
    name = "packgraph-model"
    scope = "model"


class GraphedCompiledMethod(GraphedMethod):
    name = "packgraph+compile"
    compiles = "blocks"


class GraphedModelCompiledMethod(GraphedMethod):
    name = "packgraph-model+compile"
    scope = "model"
    compiles = "model"


class CompileMethod(Method):
    name = "compile"
    warm_pool = True
    mode: str | None = None
    bucketed = True

    def __init__(self, model: GPT, policy: BucketPolicy, device: torch.device) -> None:
        torch._dynamo.reset()  # a cold start for every compile method: an honest first step
        super().__init__(model, policy, device)
        kwargs = {} if self.mode is None else {"mode": self.mode}
        self.compiled = torch.compile(model, **kwargs)
        self.counts_graphs = self.mode == "reduce-overhead"  # recompiles alone are counted in every phase

    def prepare(self, batch: PackedBatch) -> PackedBatch:
        b = batch.to(self.device)
        if not self.bucketed:
            # host_offsets are host metadata: a traced function would guard on their values (a recompile per
            # batch); the compiled model does not need them.
            b = dataclasses.replace(b, packed_seq_params=b.packed_seq_params.replace(host_offsets=None))
        return b

    def signature(self, batch: PackedBatch) -> Hashable:
        return self.bucket_key(batch) if self.bucketed else _exact_key(batch)

    def loss(self, inp: PackedBatch) -> Tensor:
        params = inp.packed_seq_params
        if self.bucketed:  # bucketing runs inside the step, as packgraph's does
            params = self.policy.apply(params).replace(host_offsets=None)
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        return self.compiled(inp.tokens, params, inp.labels, inp.loss_mask)[1]

    def graphs(self) -> int | None:
        if self.mode != "reduce-overhead":
            return None
        records = cudagraph_records()
        return None if records is None else records[0]

    def recompiles(self) -> int:
        return _dynamo_graphs() - self._dynamo_graphs0

    def extra(self) -> dict[str, Any]:
        records = cudagraph_records() if self.mode == "reduce-overhead" else None
        return {} if records is None else {"cudagraph_records_total": records[1]}

    def close(self) -> None:
        self.compiled = None
        torch._dynamo.reset()


class CompileROMethod(CompileMethod):
    name = "compile-ro"
    mode = "reduce-overhead"


class CompileRORawMethod(CompileROMethod):
    name = "compile-ro-raw"
    bucketed = False


class PaddedMethod(Method):
    name = "padded"
    padding_mask = False

    def prepare(self, batch: PackedBatch) -> PaddedBatch:
        return padded_batch(batch).to(self.device)

    def loss(self, inp: PaddedBatch) -> Tensor:
        return padded_loss(self.model, inp, padding_mask=self.padding_mask)


class PaddedMaskMethod(PaddedMethod):
    name = "padded-mask"
    padding_mask = True


def _one_process_group(device: torch.device) -> list[int] | None:
    """Join a process group of this process alone (NCCL on CUDA, gloo otherwise) unless one exists; DDP's
    ``device_ids`` for ``device``."""
    import tempfile

    import torch.distributed as dist

    if not dist.is_initialized():
        store = tempfile.NamedTemporaryFile(prefix="packgraph-bench-pg-", delete=False).name
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if device.type != "cuda":
        return None
    return [device.index if device.index is not None else torch.cuda.current_device()]


class EagerDDPMethod(Method):
    name = "eager-ddp"

    def __init__(self, model: GPT, policy: BucketPolicy, device: torch.device) -> None:
        from packgraph.distributed import summing_ddp

        super().__init__(model, policy, device)
        self.ddp = summing_ddp(model, device_ids=_one_process_group(device))

    def loss(self, inp: Any) -> Tensor:
        return self.ddp(inp.tokens, inp.packed_seq_params, inp.labels, inp.loss_mask)[1]

    def close(self) -> None:
        self.ddp = None


class GraphedDDPMethod(GraphedMethod):
    name = "packgraph-ddp"

    def __init__(self, model: GPT, policy: BucketPolicy, device: torch.device) -> None:
        from packgraph.distributed import summing_ddp

        super().__init__(model, policy, device)
        self.ddp = summing_ddp(self.graphed, device_ids=_one_process_group(device))

    def loss(self, inp: PackedBatch) -> Tensor:
        return self.ddp(inp)[1]

    def close(self) -> None:
        self.ddp = None
        super().close()


class GraphedAllreduceMethod(GraphedMethod):
    name = "packgraph-allreduce"

    def __init__(self, model: GPT, policy: BucketPolicy, device: torch.device) -> None:
        super().__init__(model, policy, device)
        _one_process_group(device)

    def step(self, inp: Any) -> None:
        from packgraph.distributed import allreduce_gradients

        with self.autocast():
            loss = self.loss(inp)
        loss.backward()
        # As under torchrun: every rank has every grad. single_rank_too: the collective runs at world size 1.
        allreduce_gradients(self.model.parameters(), every_rank_has_grads=True, single_rank_too=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.last_loss = loss.detach()


_REGISTRY: dict[str, type[Method]] = {
    cls.name: cls
    for cls in (
        Method,
        GraphedMethod,
        GraphedModelMethod,
        GraphedDocMaskMethod,
        GraphedDocMaskModelCompiledMethod,
        GraphedCompiledMethod,
        GraphedModelCompiledMethod,
        CompileMethod,
        CompileROMethod,
        CompileRORawMethod,
        PaddedMethod,
        PaddedMaskMethod,
        EagerDDPMethod,
        GraphedDDPMethod,
        GraphedAllreduceMethod,
    )
}


def make_method(name: str, model: GPT, policy: BucketPolicy, device: torch.device) -> Method:
    """Build method ``name`` around ``model`` (which it may modify: use a fresh model per method).

    Raises:
        ValueError: unknown method name.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; choose from {ALL_METHODS}")
    return _REGISTRY[name](model, policy, device)


def _dynamo_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def cudagraph_records() -> tuple[int, int] | None:
    """``(forward recordings, all recordings)`` of inductor's CUDA-graph trees on the current device.

    Forward recordings count one per distinct input signature the compiled model saw; all recordings add the
    backward graphs. None when this torch's internals are not as expected.
    """
    try:
        from torch._inductor import cudagraph_trees

        manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        if manager is None:
            return 0, 0
        forward = walked = 0
        stack = [node for nodes in manager.roots.values() for node in nodes]
        while stack:
            node = stack.pop()
            walked += 1
            mode = manager.id_to_mode.get(node.wrapped_function.id)
            forward += getattr(mode, "name", "") == "FORWARD"
            stack.extend(child for children in node.children.values() for child in children)
        # graph ids count every recording ever made, even of nodes a later generation dropped
        match = re.fullmatch(r"count\((\d+)\)", repr(manager.graph_counter))
        return forward, int(match.group(1)) if match else walked
    except Exception:
        return None
