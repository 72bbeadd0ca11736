"""Capture a callable into CUDA graphs, forward and backward, and replay it as a drop-in replacement.

:func:`capture` returns a :class:`GraphedCallable` with the callable's own call signature. Each call:

1. takes the call's signature (:mod:`packgraph.graphs.signature`): tensors and PackedSeqParams anywhere in the
   args are dynamic inputs; shapes, dtypes, ``requires_grad``, non-tensor args, the params' static signature,
   ``module.training`` and the autocast state are static. PackedSeqParams are validated (before anything is
   copied), mapped to their bucket and reduced to ``attention_view()`` first;
2. finds the graph captured for that signature, or captures one (``on_mismatch="recapture"``, bounded LRU) or
   raises :class:`~packgraph.graphs.cache.GraphSignatureError` (``on_mismatch="error"``). A stale graph never runs;
3. copies each dynamic input into its static buffer, only when it is not already there (``data_ptr``), and
   replays the forward graph inside a ``torch.autograd.Function`` whose backward replays the backward graph.

Contract and limits (read these):

* **Outputs alias static memory.** A returned tensor is a view of the graph's static output: the next replay of
  the same graph overwrites it, and so may a replay of another signature's graphs (see Memory). One forward per
  graph may be in flight: run its backward (or use ``torch.no_grad()``) before the next forward of the same
  signature (a warning says when this is broken).
* **Parameter grads** (``param_grads="graph"``, the default) are accumulated *inside* the backward graph into one
  persistent buffer per parameter, which becomes ``p.grad``: replays sum up like eager micro-batches, with no
  per-parameter device work outside the graph (one identity check per parameter on the host). After
  ``zero_grad(set_to_none=True)`` the next backward zeroes and reuses that buffer; a ``p.grad`` you assigned yourself
  is added to instead. These grads bypass autograd, so grad hooks (DDP's reducer,
  ``register_post_accumulate_grad_hook``) and ``torch.autograd.grad(loss, params)`` do not see them: use
  ``param_grads="autograd"`` for those (one accumulate per parameter per replay, on the host).
* Only the parameters of the module (or of the module a bound method belongs to) are trained; tensors a plain
  function closes over are constants. Parameters must keep their storage (``optimizer.step`` and
  ``load_state_dict`` are fine; ``module.to(dtype)`` or re-assigning a parameter needs a new capture), and their
  ``requires_grad`` must not change after capture.
* **Memory.** Everything captured together (one :func:`capture`, one :func:`capture_layers` stack, and their
  recaptures) shares one pool; warm-up runs on a side stream. Static outputs and input grads stay allocated for
  the graph's lifetime. Temporaries, and (``share_activations=True``, the default) the activations a forward saves
  for its backward, go back to the pool after capture, where later captures reuse them: the graph sets of several
  buckets hold about one set of activations, not one each. So the graphs of one pool must replay as a model runs
  them: each forward's backward before the forward of another signature, on one stream. A replay that would
  overwrite a graph whose forward ran and whose backward has not raises ``GraphOrderError`` (tracked per capture
  group; captures that share a pool through ``pool=`` are not checked against each other). A signature first met
  at call time has its forward captured at that call and its backward at its first backward, so captures follow
  the order the graphs run in.
* **RNG.** Dropout draws fresh masks at every replay (torch registers the default CUDA generator with each
  capture and advances its offset per replay); the backward graph reads the masks the forward saved. Other
  generators must be registered by the caller (``CUDAGraph.register_generator_state``).
* **Autocast** is part of the signature; warm-up and capture run with the autocast cache off, so casts of the
  weights are recorded in the graph and stay current after ``optimizer.step()``.
* Module hooks run at capture only (they are recorded, not re-run in Python).
* Tensors must reach the callable as arguments (possibly inside lists, tuples, dicts) or as module parameters and
  buffers; a tensor hidden in another object (or a closure) is a graph constant: the graph keeps reading the
  memory it had at capture.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from packgraph.graphs import safety
from packgraph.graphs.cache import CaptureGroup, GraphCache, logger
from packgraph.graphs.entry import PARAM_GRAD_MODES, Entry, explained_capture_errors
from packgraph.graphs.signature import (
    CallSignature,
    ParamsPreparer,
    autocast_state,
    dyn_keys,
    flatten_call,
    identity_statics,
    is_chained,
)

__all__ = ["capture", "capture_layers", "GraphedCallable", "PARAM_GRAD_MODES"]


# --------------------------------------------------------------------------------------------- recorder
class CudaRecorder:
    """Warms up and records CUDA graphs on one side stream into one memory pool (``pool``)."""

    device_type = "cuda"

    def __init__(self, pool: Any = None, device: torch.device | None = None) -> None:
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(self.device)

    def check_input(self, t: Tensor) -> None:
        if t.device != self.device:
            raise ValueError(f"graph inputs must be on {self.device}; got a tensor on {t.device}")

    def warmup(self, run: Callable[[], None], iters: int) -> None:
        # Lazy initialisation (cuBLAS workspaces, autotuning) must not land inside a capture.
        torch.cuda.synchronize(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream), _without_donated_buffers():
            for _ in range(iters):
                run()
        torch.cuda.synchronize(self.device)

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def record(self, body: Callable[[], list], pool: Any = None) -> tuple[Any, list]:
        graph = torch.cuda.CUDAGraph()
        pool = self.pool if pool is None else pool
        previous = torch.cuda.current_stream(self.device)
        try:
            with (
                safety.gc_paused(),  # a collection freeing an old graph would invalidate this capture
                torch.cuda.graph(
                    graph, pool=self.pool if pool is None else pool, stream=self.stream, **safety.CAPTURE_KWARGS
                ),
                _without_donated_buffers(),
            ):
                results = body()
        except BaseException:
            safety.recover_after_failed_capture(previous, self.device, pool)
            raise
        return graph, results


def _without_donated_buffers() -> contextlib.AbstractContextManager:
    """A torch.compile'd callable compiled in here keeps its saved activations for a retained backward.

    By default AOTAutograd donates saved activations to the backward, which then refuses ``retain_graph=True``
    ("compiled with non-empty donated buffers"); the engine retains the backward's graph when activations are not
    shared (``share_activations=False``, see ``entry.py``), so a compiled layer is compiled, during warm-up, without
    donation.
    """
    try:
        import torch._functorch.config as config
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(config, "donated_buffer"):
        return contextlib.nullcontext()
    return config.patch(donated_buffer=False)


def _cuda_recorder(pool: Any, sample_args: Any, who: str) -> CudaRecorder:
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{who} needs a CUDA device (CUDA graphs), but torch.cuda.is_available() is False on this machine; "
            "run the callable eagerly here"
        )
    device = next((t.device for t in pytree.tree_leaves(sample_args) if isinstance(t, Tensor) and t.is_cuda), None)
    return CudaRecorder(pool, device)


# --------------------------------------------------------------------------------------------- public
class GraphedCallable:
    """A callable (module or function) replayed from CUDA graphs; build it with :func:`capture`.

    Call it exactly like the original. Attributes: ``fn``, ``module`` (or None), ``name``, ``num_graphs`` (cached
    signatures), ``captures`` (graphs captured so far), ``recaptures`` (captures made at call time, after the
    initial one), ``evictions``, ``signatures``.
    """

    def __init__(
        self,
        fn: Callable,
        group: CaptureGroup,
        *,
        num_warmup_iters: int = 3,
        on_mismatch: str = "recapture",
        max_graphs: int = 8,
        forward_only: bool = False,
        validate: str = "host",
        param_grads: str = "graph",
        share_activations: bool = True,
        name: str | None = None,
    ) -> None:
        if param_grads not in PARAM_GRAD_MODES:
            raise ValueError(f"param_grads must be one of {PARAM_GRAD_MODES}, got {param_grads!r}")
        if num_warmup_iters < 1:
            raise ValueError(f"num_warmup_iters must be >= 1, got {num_warmup_iters}")
        self.fn = fn
        owner = getattr(fn, "__self__", None)
        self.module = fn if isinstance(fn, nn.Module) else owner if isinstance(owner, nn.Module) else None
        # Every submodule's train/eval flag is static (a Dropout switched to eval alone changes the graph).
        self._submodules = list(self.module.modules()) if self.module is not None else []
        self.group = group
        self.name = name or _name_of(fn)
        self.cache: GraphCache[Entry] = GraphCache(max_graphs=max_graphs, on_mismatch=on_mismatch, name=self.name)
        self.num_warmup_iters = num_warmup_iters
        self.forward_only = forward_only
        self.debug = validate == "debug"
        self.param_grads = param_grads
        self.share_activations = share_activations
        params = {id(p): p for p in self.module.parameters()} if self.module is not None else {}
        self.trainable_params = [p for p in params.values() if p.requires_grad] if not forward_only else []
        self.anchor = None
        if self.trainable_params:
            self.anchor = torch.empty(0, device=self.trainable_params[0].device, requires_grad=True)
        self.uid = id(self)
        self.recaptures = 0
        self._warned_unchained = False
        self._warned_opaque = False
        registry = group.outputs
        self._chain_of = None if registry is None else (lambda t: registry.lookup(t, self.uid))
        self._device_type = group.recorder.device_type

    @property
    def num_graphs(self) -> int:
        return len(self.cache)

    @property
    def captures(self) -> int:
        return self.cache.captures

    @property
    def evictions(self) -> int:
        return self.cache.evictions

    @property
    def signatures(self) -> list[CallSignature]:
        return list(self.cache)

    def signature(self, args: tuple, kwargs: dict) -> tuple[CallSignature, list]:
        """``(signature, dynamic inputs)`` of a call. Validates its PackedSeqParams (may raise)."""
        args_key, kwargs_key, dyn = flatten_call(args, kwargs, self.group.preparer, self._chain_of)
        training = None
        if self._submodules:
            flags = tuple(m.training for m in self._submodules)
            # One bool when the whole module agrees (the usual case, and the readable one in error messages).
            training = flags[0] if len(set(flags)) == 1 else flags
        return CallSignature(args_key, kwargs_key, training, autocast_state(self._device_type)), dyn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key, dyn = self.signature(args, kwargs)
        entry = self.cache.get(key)
        if entry is None:
            entry = self._recapture(key, args, kwargs)
        return entry.run(dyn)

    def _recapture(self, key: CallSignature, args: tuple, kwargs: dict) -> Entry:
        self.cache.check_new(key)
        # The backward waits for its first use: captures then follow the order the graphs run in (see
        # Entry.capture_backward_late), and a forward-only use never captures one.
        (entry,) = _capture_stack([self], args, kwargs, backward=False)
        if self.group.chain and not entry.chained and not self._warned_unchained:
            if any(e.chained for e in self.cache.values()):
                self._warned_unchained = True
                logger.warning(
                    "%s: called with an input that is not the previous layer's graph output, so it gets a graph "
                    "that copies its input. If the layers do not feed each other directly (an eager block sits "
                    "between them), pass chain=False to capture_layers.",
                    self.name,
                )
        self.recaptures += 1
        self._insert(entry)
        return entry

    def _insert(self, entry: Entry) -> None:
        opaque = identity_statics(entry.key)
        if opaque and not self._warned_opaque:
            self._warned_opaque = True
            logger.warning(
                "%s: %s %s compared by identity (unhashable, not a tensor, PackedSeqParams or container): every "
                "new object is a new signature and a new capture, and tensors inside it are graph constants. Pass "
                "tensors and PackedSeqParams as arguments, or hashable values.",
                self.name,
                ", ".join(opaque),
                "is" if len(opaque) == 1 else "are",
            )
        kind = "fwd+bwd" if entry.bwd_graph is not None else "fwd, bwd at first use" if entry.trains else "fwd"
        for old in self.cache.insert(entry.key, entry, seconds=entry.capture_seconds, kind=kind):
            old.release()

    def __repr__(self) -> str:
        return f"GraphedCallable({self.name}, graphs={self.num_graphs}, captures={self.captures})"


def _name_of(fn: Callable) -> str:
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _capture_stack(
    graphed: Sequence[GraphedCallable], args: tuple, kwargs: dict, *, backward: bool = True
) -> list[Entry]:
    """Capture ``x = g(x, *args[1:], **kwargs)`` for each ``g`` in turn: forwards in order, then backwards in
    reverse (the order a model runs them). One callable is the plain single capture. In a chained group each
    layer reads the previous layer's static output in place, and each backward reads the next layer's input-grad
    buffer as its output grad. ``backward=False`` leaves each backward graph to be captured at its first use."""
    entries: list[Entry] = []
    started = []
    for k, g in enumerate(graphed):
        if k > 0:
            prev = entries[-1]
            if not prev.single_output:
                raise ValueError(
                    f"capture_layers: {prev.owner.name} must return one tensor (it becomes the next layer's first "
                    "argument); wrap layers that return more"
                )
            out = prev.static_outputs[0]
            args = (out.detach().requires_grad_(out.requires_grad), *args[1:])
        started.append(time.perf_counter())
        key, dyn = g.signature(args, kwargs)
        entry = Entry(g, key, args, kwargs, dyn)
        with explained_capture_errors(entry):
            entry.warm_up()
            entry.capture_forward()
        if k + 1 < len(graphed):
            entry.fwd_graph.replay()  # real values in the output the next layer warms up on
        entry.capture_seconds = time.perf_counter() - started[-1]
        entries.append(entry)
    for k in reversed(range(len(entries)) if backward else ()):
        t0 = time.perf_counter()
        entry = entries[k]
        given = {}
        if k + 1 < len(entries) and is_chained(dyn_keys(entries[k + 1].key)[0]):
            chained_grad = entries[k + 1].grad_input_buffer(0)
            if chained_grad is not None:
                given[0] = chained_grad
        with explained_capture_errors(entry):
            entry.capture_backward(given)
        entry.capture_seconds += time.perf_counter() - t0
    return entries


def _make_group(recorder: Any, *, validate: str, buckets: Any, keep_mamba_fields: bool, chain: bool) -> CaptureGroup:
    preparer = ParamsPreparer(validate=validate, buckets=buckets, keep_mamba_fields=keep_mamba_fields)
    return CaptureGroup(recorder, preparer, chain=chain)


def _as_args(sample_args: Any) -> tuple:
    return tuple(sample_args) if isinstance(sample_args, (tuple, list)) else (sample_args,)


def capture_with(
    recorder: Any,
    fn_or_module: Callable,
    sample_args: Any,
    sample_kwargs: dict | None = None,
    *,
    validate: str = "host",
    buckets: Any = None,
    keep_mamba_fields: bool = False,
    **options: Any,
) -> GraphedCallable:
    """:func:`capture` with an explicit recorder: the CUDA one, or a stand-in (CPU tests replay eagerly).

    The recorder protocol (what :class:`CudaRecorder` implements):

    * ``device_type``: the autocast device type of the signature (``"cuda"``);
    * ``check_input(tensor)``: raise if a dynamic input cannot be a graph input (wrong device);
    * ``warmup(run, iters)``: call ``run()`` ``iters`` times, eagerly (CUDA: on the side stream);
    * ``record(body, pool=None) -> (graph, results)``: capture ``body()`` (which returns a list of tensors, the
      graph's static results) into the recorder's pool, or ``pool``, and return an object whose ``replay()`` re-runs
      the recorded work, writing into ``results``;
    * optional ``new_pool()``: a fresh memory pool (for a capture that must not reuse the shared pool's memory);
    * optional ``records_by_running = True``: ``record`` runs the body (a stand-in), so the engine keeps the
      autograd graph a backward body consumes.
    """
    group = _make_group(recorder, validate=validate, buckets=buckets, keep_mamba_fields=keep_mamba_fields, chain=False)
    graphed = GraphedCallable(fn_or_module, group, validate=validate, **options)
    (entry,) = _capture_stack([graphed], _as_args(sample_args), dict(sample_kwargs or {}))
    graphed._insert(entry)
    return graphed


def capture_layers_with(
    recorder: Any,
    layers: Sequence[Callable],
    sample_args: Any,
    sample_kwargs: dict | None = None,
    *,
    chain: bool = True,
    validate: str = "host",
    buckets: Any = None,
    keep_mamba_fields: bool = False,
    **options: Any,
) -> list[GraphedCallable]:
    """:func:`capture_layers` with an explicit recorder."""
    if not layers:
        raise ValueError("capture_layers needs at least one layer")
    group = _make_group(recorder, validate=validate, buckets=buckets, keep_mamba_fields=keep_mamba_fields, chain=chain)
    graphed = [
        GraphedCallable(layer, group, validate=validate, name=f"layer[{k}] {_name_of(layer)}", **options)
        for k, layer in enumerate(layers)
    ]
    for g, entry in zip(
        graphed, _capture_stack(graphed, _as_args(sample_args), dict(sample_kwargs or {})), strict=True
    ):
        g._insert(entry)
    return graphed


def capture(
    fn_or_module: Callable,
    sample_args: Any,
    sample_kwargs: dict | None = None,
    *,
    num_warmup_iters: int = 3,
    pool: Any = None,
    on_mismatch: str = "recapture",
    max_graphs: int = 8,
    forward_only: bool = False,
    buckets: Any = None,
    validate: str = "host",
    keep_mamba_fields: bool = False,
    param_grads: str = "graph",
    share_activations: bool = True,
) -> GraphedCallable:
    """Capture ``fn_or_module`` into CUDA graphs (forward, and backward unless ``forward_only``).

    Args:
        fn_or_module: an ``nn.Module`` (its parameters are trained), a bound method of one, or a function.
        sample_args / sample_kwargs: a representative call (a lone tensor may stand for a 1-tuple). Their static
            signature is captured now; other signatures are captured at their first call.
        num_warmup_iters: eager iterations on a side stream before each capture.
        pool: a ``torch.cuda.graph_pool_handle()`` to share with other captures; default a fresh one.
        on_mismatch: ``"recapture"`` (bounded LRU of ``max_graphs``) or ``"error"`` (:class:`GraphSignatureError`).
        forward_only: no-grad graphs (scoring, eval): no backward, no saved activations.
        buckets: a ``BucketPolicy``: the caller passes a batch's true params and the engine re-pads them to their
            bucket (on the device, no sync) before the signature is taken.
        validate: how each call's PackedSeqParams are checked *before* anything is copied:
            ``"host"`` (default) reads ``host_offsets`` when present, no sync; device-only params get the
            structural checks only. ``"sync"``: device-only params cost one device-to-host read per new params
            object (a stall of the host until the GPU catches up). ``"debug"``: ``"host"`` plus
            ``torch._assert_async`` checks recorded in the graph; a failing check is a device-side assert that
            poisons the CUDA context (the process must restart). ``"off"``: no checks. Host offsets made stale
            by an in-place write are not trusted. Checks run once per params object while its tensors' versions
            hold; under ``torch.inference_mode`` tensors carry no version, so every call re-checks and re-buckets
            (host work only): score under ``torch.no_grad()`` to avoid it.
        keep_mamba_fields: let ``total_tokens``/``seq_idx`` into the graph (and its signature).
        param_grads: ``"graph"`` (accumulate inside the backward graph) or ``"autograd"`` (see the module doc).
        share_activations: let the graphs of every signature share one set of saved activations (memory of one
            graph set, however many buckets). Replays must then follow the model's order; a replay that would
            overwrite an unfinished forward raises :class:`~packgraph.graphs.entry.GraphOrderError`. ``False``
            keeps each signature's activations apart.

    Returns:
        a :class:`GraphedCallable`.

    Raises:
        RuntimeError: no CUDA device; :class:`~packgraph.graphs.safety.GraphCaptureError` when the callable cannot
            be captured (it names the offending line, e.g. a host sync, and the fix).
    """
    recorder = _cuda_recorder(pool, (sample_args, sample_kwargs), "packgraph.capture")
    return capture_with(
        recorder,
        fn_or_module,
        sample_args,
        sample_kwargs,
        num_warmup_iters=num_warmup_iters,
        on_mismatch=on_mismatch,
        max_graphs=max_graphs,
        forward_only=forward_only,
        buckets=buckets,
        validate=validate,
        keep_mamba_fields=keep_mamba_fields,
        param_grads=param_grads,
        share_activations=share_activations,
    )


def capture_layers(
    layers: Sequence[Callable],
    sample_args: Any,
    sample_kwargs: dict | None = None,
    *,
    chain: bool = True,
    pool: Any = None,
    **options: Any,
) -> list[GraphedCallable]:
    """Capture N layers into one memory pool, for a stack run as ``x = layer(x, *rest)``.

    Layer ``k``'s sample input is layer ``k - 1``'s sample output (``sample_args[0]`` feeds layer 0; the rest of
    ``sample_args`` and ``sample_kwargs`` go to every layer). Forwards are captured in order, backwards in reverse.
    Each layer must return one tensor.

    With ``chain=True`` (default) layer ``k``'s graph reads layer ``k - 1``'s output where the graph wrote it, and
    its backward writes the grad where layer ``k - 1``'s backward reads it: no copies between layers. A call whose
    input is some other tensor still works (it gets a graph of its own that copies the input, with a warning);
    pass ``chain=False`` when the layers do not feed each other directly (e.g. only the attention half of each
    block is captured and the MLP between runs eagerly).

    Other options are :func:`capture`'s. Returns one :class:`GraphedCallable` per layer.
    """
    recorder = _cuda_recorder(pool, (sample_args, sample_kwargs), "packgraph.capture_layers")
    return capture_layers_with(recorder, layers, sample_args, sample_kwargs, chain=chain, **options)
