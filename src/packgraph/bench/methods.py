"""The training-step methods ``packgraph bench`` compares, and how one is measured in one cell.

Every method runs a full training step of the same :class:`~packgraph.models.gpt.GPT` (same seed, same weights):
forward, backward, ``AdamW.step()``, ``zero_grad(set_to_none=True)``; bf16 autocast on CUDA, float32 on CPU.
All of them consume the same stream of documents (:mod:`packgraph.bench.data`); they differ in what they feed
the model and what runs it:

===========================  ===============================================================================
``eager``                    exact ``cu_seqlens`` (capacity = documents) and the true ``max_seqlen``
``packgraph``                ``model.graphed(scope="layer")`` (``capture_layers``), default buckets
``packgraph-model``          ``model.graphed(scope="model")``: forward and backward of the whole loss, bucketed
``packgraph+compile``        each block ``torch.compile`` d (``mode="default"``, fusion), then captured by packgraph
``packgraph-model+compile``  the whole model ``torch.compile`` d (``mode="default"``), captured with scope
                             ``"model"``: compile-RO's fusion (embedding, head and loss too) with packgraph's graphs
``compile``                  ``torch.compile(model)``, fed the bucketed (fixed-shape) batches
``compile-ro``               ``torch.compile(model, mode="reduce-overhead")`` with ``cudagraph_mark_step_begin()``,
                             fed the bucketed batches
``compile-ro-raw``           the same, fed the raw exact batches: every new (capacity, max_seqlen) may re-record
``padded``                   no packing: documents right-padded to the batch max, ``[B, L]``, SDPA causal
``padded-mask``              the same with an explicit causal & key-padding boolean mask (SDPA's masked kernel)
===========================  ===============================================================================

``padded`` needs no mask for exactness: with right padding, a causal query row of a real token only sees keys at
or before it, which are all real. The padding enters through the loss mask (pad rows have label -100), so the
padded loss equals the packed one. ``padded-mask`` is the literal recipe (a boolean mask forces SDPA off its
flash kernel) for those who want that baseline too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import re
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import Tensor

from packgraph.bench.data import doc_tokens
from packgraph.buckets import BucketPolicy
from packgraph.data.corpus import PAD_ID
from packgraph.models.gpt import GPT, masked_mean_ce
from packgraph.ops import apply_rope_thd
from packgraph.packing import IGNORE_INDEX, PackedBatch

__all__ = [
    "METHODS",
    "ALL_METHODS",
    "CUDA_ONLY_METHODS",
    "Measurement",
    "Method",
    "PaddedBatch",
    "cudagraph_records",
    "KERNEL_CLASSES",
    "KernelProfile",
    "gpu_busy_ms",
    "kernel_class",
    "make_method",
    "short_kernel_name",
    "measure",
    "padded_batch",
    "padded_loss",
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

ALL_METHODS: tuple[str, ...] = (*METHODS, "padded-mask")
CUDA_ONLY_METHODS: frozenset[str] = frozenset(
    {"packgraph", "packgraph-model", "packgraph+compile", "packgraph-model+compile", "compile-ro", "compile-ro-raw"}
)


# ---------------------------------------------------------------------------------------------- padded layout
@dataclass
class PaddedBatch:
    """Documents right-padded to the batch max: ``tokens``, ``labels``, ``loss_mask`` are ``[B, L]``.

    ``lengths`` (int64 ``[B]``) are the real lengths; pad rows hold ``PAD_ID``, label -100 and mask 0.
    """

    tokens: Tensor
    labels: Tensor
    loss_mask: Tensor
    lengths: Tensor

    def to(self, device: torch.device | str) -> PaddedBatch:
        return PaddedBatch(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


def padded_batch(batch: PackedBatch) -> PaddedBatch:
    """The documents of a host-side packed batch as a padded ``[B, L]`` batch with the same labels and mask."""
    offsets = batch.packed_seq_params.host_offsets["cu_seqlens_q"]
    docs = doc_tokens(batch)
    B, L = max(len(docs), 1), max((len(d) for d in docs), default=1)
    tokens = torch.full((B, L), PAD_ID, dtype=torch.int64)
    labels = torch.full((B, L), IGNORE_INDEX, dtype=torch.int64)
    loss_mask = torch.zeros(B, L, dtype=torch.float32)
    for i, d in enumerate(docs):
        a, n = offsets[i], len(d)
        tokens[i, :n] = d
        labels[i, :n] = batch.labels[a : a + n]
        loss_mask[i, :n] = batch.loss_mask[a : a + n]
    lengths = torch.tensor([len(d) for d in docs] or [0], dtype=torch.int64)
    return PaddedBatch(tokens, labels, loss_mask, lengths)


def padded_loss(model: GPT, batch: PaddedBatch, *, padding_mask: bool = False) -> Tensor:
    """The GPT's masked-mean loss on a padded ``[B, L]`` batch, with the model's own modules and weights.

    Mirrors ``AttentionBlock.forward`` with ``[B, L]`` rows: RoPE positions ``0..L-1`` per row
    (``apply_rope_thd`` with ``position_ids``) and SDPA instead of varlen attention. Causal SDPA is exact on real
    rows (see the module docstring); ``padding_mask=True`` passes an explicit ``causal & key_valid`` mask.
    """
    B, L = batch.tokens.shape
    device = batch.tokens.device
    x = model.embed_tokens(batch.tokens)
    positions = torch.arange(L, device=device).repeat(B)
    attn_mask = None
    if padding_mask:
        key_valid = torch.arange(L, device=device)[None, :] < batch.lengths[:, None]
        causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
        attn_mask = causal[None, None] & key_valid[:, None, None, :]
    for block in model.blocks:
        a = block.attn
        H, Hkv, D = a.n_head, a.n_kv_head, a.head_dim
        q, k, v = a.qkv(a.norm(x)).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = apply_rope_thd(q.reshape(B * L, H, D), None, base=a.rope_base, position_ids=positions)
        k = apply_rope_thd(k.reshape(B * L, Hkv, D), None, base=a.rope_base, position_ids=positions)
        q, k, v = (t.reshape(B, L, -1, D).transpose(1, 2) for t in (q, k, v))
        if Hkv != H:
            k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None)
        x = x + a.dropout(a.proj(y.transpose(1, 2).reshape(B, L, H * D)))
        x = block.mlp(x)
    logits = model.logits_from_hidden(x)
    return masked_mean_ce(logits.reshape(B * L, -1), batch.labels.reshape(-1), batch.loss_mask.reshape(-1))


# ---------------------------------------------------------------------------------------------- methods
def _adamw(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    kwargs: dict[str, Any] = dict(lr=1e-4, weight_decay=0.1)
    if device.type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters:
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


_REGISTRY: dict[str, type[Method]] = {
    cls.name: cls
    for cls in (
        Method,
        GraphedMethod,
        GraphedModelMethod,
        GraphedCompiledMethod,
        GraphedModelCompiledMethod,
        CompileMethod,
        CompileROMethod,
        CompileRORawMethod,
        PaddedMethod,
        PaddedMaskMethod,
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


# ---------------------------------------------------------------------------------------------- counters
def _dynamo_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
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


# ---------------------------------------------------------------------------------------------- measuring
KERNEL_CLASSES: tuple[tuple[str, str], ...] = (
    ("attention bwd", r"flash.*(bwd|backward)|(bwd|backward).*flash|fmha.*bwd"),
    ("attention fwd", r"flash|fmha"),
    ("optimizer", r"adam"),
    ("foreach (grad buffers)", r"multi_tensor"),
    ("gemm", r"gemm|cutlass|nvjet|cublas|xmma|sm\d+_.*(tn|nt|nn|tt)"),
    ("inductor (triton)", r"^triton_"),
    ("reduction", r"reduce|norm|softmax|cross_entropy|nll_loss|sum_"),
    ("elementwise", r"elementwise|vectorized|unrolled|fill|copy|cat_|index|gather|scatter|embedding"),
    ("memcpy/memset", r"^(memcpy|memset)"),
)
"""``(class, regex)`` pairs, first match wins (case-insensitive): how :func:`gpu_busy_ms` groups kernel time, so
that two methods' GPU-busy times can be compared class by class. Anything else is ``"other"``."""

_CLASS_PATTERNS = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in KERNEL_CLASSES]


_NOISE = re.compile(r"\bvoid |\(anonymous namespace\)::|at::native::|at::cuda::|pytorch_flash::|cutlass::")


def short_kernel_name(name: str, limit: int = 160) -> str:
    """``name`` without the namespaces that make kernel names long, cut at ``limit`` characters."""
    return _NOISE.sub("", name)[:limit]


def kernel_class(name: str) -> str:
    """The :data:`KERNEL_CLASSES` class of a device activity named ``name`` (``"other"`` if none matches)."""
    return next((cls for cls, pattern in _CLASS_PATTERNS if pattern.search(name)), "other")


@dataclass
class KernelProfile:
    """Device time of some steps under ``torch.profiler``, per step (ms): kernels, copies/memsets, by class.

    ``busy_ms`` sums kernel durations (kernels inside CUDA graph replays included, as CUPTI reports them);
    ``copy_ms`` the memcpy/memset activities, which ``busy_ms`` excludes. ``kernels`` counts the kernels per
    step (copies excluded): with ``step / busy`` it tells the idle time per kernel boundary, the launch gaps a
    CUDA graph still has between its kernels. ``by_class`` splits the times by :func:`kernel_class`; ``top``
    lists the ``[name, ms]`` of the heaviest kernels (:func:`short_kernel_name`).
    """

    steps: int
    busy_ms: float
    copy_ms: float
    kernels: float
    by_class: dict[str, float]
    top: list[list[Any]]


def gpu_busy_ms(fn: Callable[[int], None], steps: int = 1, top: int = 12) -> KernelProfile:
    """Run ``fn(0) .. fn(steps - 1)`` under ``torch.profiler`` and return their device time per step.

    Device activity only. The kernel records are the same as with host activity, but a host+device profile
    also lists each ``record_function`` range as a device event spanning its kernels (AdamW's
    ``Optimizer.step#AdamW.step``: 0.44 ms per step at ``small``, H200), which a sum over device events counts
    on top of those kernels. Leaving out the host ops (thousands per eager step) also saves the seconds the
    profiler spends building their event tree.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    # One profiling cycle, read after it ends: acc_events keeps its events for that read (torch >= 2.10 warns,
    # at the read, that a cycle's events are cleared otherwise).
    options = {"acc_events": True} if "acc_events" in inspect.signature(profile.__init__).parameters else {}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA], **options) as prof:
        for i in range(steps):
            fn(i)
        torch.cuda.synchronize()
    by_name: dict[str, float] = {}
    count: dict[str, int] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            by_name[event.name] = by_name.get(event.name, 0.0) + event.time_range.elapsed_us() / 1e3 / steps
            count[event.name] = count.get(event.name, 0) + 1
    by_class: dict[str, float] = {}
    kernels = 0
    for name, ms in by_name.items():  # classified once per name (an eager step has ~2000 kernels, ~70 names)
        cls = kernel_class(name)
        by_class[cls] = by_class.get(cls, 0.0) + ms
        kernels += count[name] if cls != "memcpy/memset" else 0
    copies = by_class.get("memcpy/memset", 0.0)
    heaviest = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return KernelProfile(
        steps=steps,
        busy_ms=sum(by_name.values()) - copies,
        copy_ms=copies,
        kernels=kernels / steps,
        by_class=dict(sorted(by_class.items(), key=lambda kv: -kv[1])),
        top=[[short_kernel_name(name), ms] for name, ms in heaviest],
    )


@dataclass
class Measurement:
    """What :func:`measure` found for one method in one cell (times in ms unless named ``_s``)."""

    timer: str
    steps: int
    step_ms: float
    step_ms_p10: float
    step_ms_p90: float
    real_tokens_per_step: float
    first_step_s: float
    first_loss: float
    gpu_busy_ms: float | None
    gpu_copy_ms: float | None
    kernels_per_step: float | None
    busy_steps: int | None
    step_ms_busy_batches: float | None
    gpu_busy_by_class: dict[str, float] | None
    top_kernels: list[list[Any]] | None
    graphs: int | None
    graph_batches: int | None
    predicted_graphs: int | None
    recompiles: int | None
    peak_mem_mib: float | None
    peak_mem_timed_mib: float | None
    peak_reserved_mib: float | None
    elapsed_s: float
    extra: dict[str, Any]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def measure(
    method: Method,
    stream: Sequence[PackedBatch],
    *,
    steps: int,
    warmup: int,
    graph_batches: int,
    graph_budget_s: float,
    profile: bool = True,
    profile_steps: int = 8,
) -> Measurement:
    """Measure ``method`` on ``stream`` (host batches; needs ``len(stream) >= steps``).

    Phases, in order:

    1. **first step** on ``stream[0]``, wall clock including capture/compilation (``first_step_s``);
    2. **warm-up**: methods with a per-signature cache (graphs, compilation) run every batch of the timed pool
       ``stream[:steps]`` once, so the timed loop replays; the others run ``warmup`` steps;
    3. **timed**: ``steps`` steps over the pool, each timed with CUDA events (``perf_counter`` on CPU); the
       median is ``step_ms``;
    4. **profile** (CUDA): the first ``profile_steps`` batches of the pool again, under ``torch.profiler``:
       ``gpu_busy_ms`` is their kernel time per step, ``step_ms_busy_batches`` the mean timed step of the same
       batches, so that step/busy compares like with like (a pool mixes buckets, each with its own kernel time);
    5. **graph count** (cache methods): continue over ``stream[steps:graph_batches]`` within
       ``graph_budget_s`` seconds; ``graphs`` is what the method recorded over the ``graph_batches`` batches
       it saw, ``predicted_graphs`` the distinct host signatures among them.
    """
    device = method.device
    cuda = device.type == "cuda"
    pool = min(steps, len(stream))
    if pool < 1:
        raise ValueError("measure needs steps >= 1 and a non-empty stream")
    inputs: dict[int, Any] = {}
    started = time.perf_counter()

    def run(i: int) -> None:
        if i not in inputs:
            inputs[i] = method.prepare(stream[i])
        method.step(inputs[i])

    for i in range(pool):  # inputs live on the device before any timing
        inputs[i] = method.prepare(stream[i])
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    run(0)
    _sync(device)
    first_step_s = time.perf_counter() - t0
    first_loss = float(method.last_loss)

    warm = range(1, pool) if method.warm_pool else range(1, 1 + warmup)
    for i in warm:
        run(i % pool)
    _sync(device)

    order = [i % pool for i in range(steps)]
    times: list[float] = []
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in order]
        for i, (start, end) in zip(order, events, strict=True):
            start.record()
            method.step(inputs[i])
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for i in order:
            t = time.perf_counter()
            method.step(inputs[i])
            times.append((time.perf_counter() - t) * 1e3)
    real_tokens = statistics.fmean(sum(stream[i].doc_lengths) for i in order)
    peak_timed = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None

    kernels = step_busy_batches = None
    if cuda and profile:
        k = min(profile_steps, pool)
        kernels = gpu_busy_ms(lambda i: method.step(inputs[i]), steps=k)
        per_batch: dict[int, list[float]] = {}
        for i, t in zip(order, times, strict=True):
            per_batch.setdefault(i, []).append(t)
        step_busy_batches = statistics.fmean(statistics.median(per_batch[i]) for i in range(k))

    graphs = graph_batches_seen = predicted = None
    if method.counts_graphs:
        seen = pool
        deadline = time.perf_counter() + graph_budget_s
        while seen < min(graph_batches, len(stream)) and time.perf_counter() < deadline:
            run(seen)
            seen += 1
        _sync(device)
        graphs, graph_batches_seen = method.graphs(), seen
        predicted = len({method.signature(b) for b in stream[:seen]})
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
    # Reserved counts what tensors do not: graph-pool memory that is free between captures, allocator caching.
    peak_reserved = torch.cuda.max_memory_reserved(device) / 2**20 if cuda else None
    return Measurement(
        timer="cuda-events" if cuda else "perf-counter",
        steps=len(times),
        step_ms=statistics.median(times),
        step_ms_p10=_quantile(times, 0.1),
        step_ms_p90=_quantile(times, 0.9),
        real_tokens_per_step=real_tokens,
        first_step_s=first_step_s,
        first_loss=first_loss,
        gpu_busy_ms=kernels.busy_ms if kernels else None,
        gpu_copy_ms=kernels.copy_ms if kernels else None,
        kernels_per_step=kernels.kernels if kernels else None,
        busy_steps=kernels.steps if kernels else None,
        step_ms_busy_batches=step_busy_batches,
        gpu_busy_by_class=kernels.by_class if kernels else None,
        top_kernels=kernels.top if kernels else None,
        graphs=graphs,
        graph_batches=graph_batches_seen,
        predicted_graphs=predicted,
        recompiles=method.recompiles(),
        peak_mem_mib=peak,
        peak_mem_timed_mib=peak_timed,
        peak_reserved_mib=peak_reserved,
        elapsed_s=time.perf_counter() - started,
        extra=method.extra(),
    )


def release(device: torch.device) -> None:
    """Free what a finished method left behind (call after dropping every reference to it).

    Never raises: after a device-side fault the context is unusable and every later method records that
    error instead of this cleanup ending the run.
    """
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        except Exception:  # a poisoned CUDA context: let the next method report it
            pass
