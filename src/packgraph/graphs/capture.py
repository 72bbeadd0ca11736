"""Capture a callable into CUDA graphs, forward and backward, and replay it as a drop-in replacement.

:func:`capture` returns a :class:`GraphedCallable` with the callable's own call signature; its docstring is the
contract. Each call:

1. takes the call's signature (:mod:`packgraph.graphs.signature`); PackedSeqParams are validated, mapped to their
   bucket and reduced to ``attention_view()`` first, before anything is copied;
2. finds the graph captured for that signature, or captures one (``on_mismatch="recapture"``) or raises
   :class:`~packgraph.graphs.cache.GraphSignatureError` (``on_mismatch="error"``). A stale graph never runs;
3. copies each dynamic input into its static buffer when it is not already there (``data_ptr``), and replays the
   forward graph inside a ``torch.autograd.Function`` whose backward replays the backward graph
   (:mod:`packgraph.graphs.entry`).

What graphs share, and the replay order that costs, is :mod:`packgraph.graphs.memory`'s; streams and proxies are
:mod:`packgraph.graphs.recorder`'s.
"""

from __future__ import annotations

import functools
import operator
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

import torch
from torch import Tensor, nn

from packgraph.graphs import memory
from packgraph.graphs.cache import CaptureGroup, GraphCache, logger
from packgraph.graphs.entry import Entry, explained_capture_errors
from packgraph.graphs.memory import GraphOrderError, Handout, Pool, SharedBuffers
from packgraph.graphs.recorder import Recorder, recorder_for
from packgraph.graphs.signature import (
    CallSignature,
    ParamsPreparer,
    autocast_state,
    dyn_keys,
    flatten_call,
    identity_statics,
    is_chained,
)

if TYPE_CHECKING:
    from packgraph.buckets import BucketPolicy

__all__ = [
    "capture",
    "capture_layers",
    "capture_with",
    "capture_layers_with",
    "GraphedCallable",
    "call_with_forward",
    "is_fsdp_unit",
    "is_dtensor",
]


# --------------------------------------------------------------------------------------------- public
def _fsdp_role(module: nn.Module, name: str, inside_units: bool = False) -> str | None:
    """How FSDP2 (``fully_shard``) holds ``module``'s parameters: ``"unit"`` (the module is an FSDP2 unit),
    ``"part"`` (a submodule of a unit: DTensor parameters, gathered only inside the unit's forward and backward) or
    None. A module holding units below it is refused with ``NotImplementedError``: their hooks gather and free
    parameters inside what a graph of it would replay. Unless ``inside_units``: the callable then runs inside the
    units' forwards, calling what they hold without their hooks (an adapter that calls a unit's original forward
    from within the unit's own call), and is a part too."""
    types = _fsdp_types()
    if types is None:
        return None
    FSDPModule, DTensor = types  # noqa: N806
    inner = [m for m in module.modules() if isinstance(m, FSDPModule) and m is not module]
    if inner and inside_units:
        return "part"
    if inner:
        raise NotImplementedError(
            f"{name}: it holds FSDP2 units (fully_shard) below it, whose hooks gather their parameters into new "
            "storage and free them inside what a graph of it would replay. Graph each unit instead (capture_layers "
            "over the sharded layers, scope 'layer'): their gathers then run eagerly around the graphs"
        )
    if isinstance(module, FSDPModule):
        return "unit"
    if any(isinstance(p, DTensor) for p in module.parameters()):
        return "part"
    return None


def is_fsdp_unit(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 unit (``fully_shard``)."""
    types = _fsdp_types()
    return types is not None and isinstance(module, types[0])


def is_dtensor(t: Tensor) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2 shard, outside its unit's gather)."""
    types = _fsdp_types()
    return types is not None and isinstance(t, types[1])


@functools.cache
def _fsdp_types() -> tuple[type, type] | None:
    """``(FSDPModule, DTensor)``, or None in a torch without FSDP2."""
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return FSDPModule, DTensor


def call_with_forward(module: nn.Module, forward: Callable, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` with ``forward`` in place of its forward: its hooks (FSDP2's gather before,
    reshard after, and their backward counterparts) run around ``forward`` as they run around an eager one."""
    previous = module.__dict__.get("forward")
    module.forward = forward
    try:
        return module(*args, **kwargs)
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


class ModuleTree:
    """The module a callable's graphs are captured from, as they read it: every submodule (each one's train/eval
    flag is static: a Dropout switched to eval alone changes the graph), every parameter and buffer at its address,
    and a snapshot of each table of submodules, parameters, buffers and hooks, which :meth:`changed` checks at every
    call, on the host.

    ``copies_params`` (FSDP2): the graphs read static copies of the parameters (:meth:`param_copies`), whose own
    addresses move at every gather, so only the buffers' are checked. ``on_adopt(param)`` becomes a
    post-accumulate-grad hook of every parameter that requires grad, removed with the tree or at the next scan.
    """

    def __init__(
        self, module: nn.Module | None, *, copies_params: bool, on_adopt: Callable[[Tensor], None] | None
    ) -> None:
        self.module = module
        self.copies_params = copies_params
        self.on_adopt = on_adopt
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        weakref.finalize(self, _remove_hooks, self._hooks)
        self.scan()

    def scan(self) -> None:
        """Take the snapshot anew (after a change the caller has dealt with)."""
        self.submodules = list(self.module.modules()) if self.module is not None else []
        places, params, seen, checked = [], [], set(), []
        tables = [table for mod in self.submodules for table in _tree_tables(mod)]
        entries = [(table, key, value) for table in tables for key, value in table.items()]
        for mod in self.submodules:
            for table, is_param in ((mod._parameters, True), (mod._buffers, False)):
                for name, t in table.items():
                    if t is None:
                        continue
                    places.append((table, name, t, t.data_ptr()))
                    if not (is_param and self.copies_params):
                        checked.append((t, t.data_ptr()))
                    if is_param and id(t) not in seen:
                        seen.add(id(t))
                        params.append(t)
        self.places: list[tuple[dict, str, Tensor, int]] = places  # (table, name, tensor, data_ptr)
        self.params: list[Tensor] = params
        # Checked at every call with C-level maps (a model's tree has hundreds of tables). The snapshot holds the
        # values themselves, so identity means what it meant at capture.
        self._tables = (tables, list(map(len, tables)), *(list(column) for column in zip(*entries, strict=True)))
        self._tensors = ([t for t, _ in checked], [ptr for _, ptr in checked])
        self._param_copies: dict[int, Tensor] = {}
        _remove_hooks(self._hooks)
        if self.on_adopt is not None:  # (a parameter unfrozen later is found through its .grad)
            self._hooks += [p.register_post_accumulate_grad_hook(self.on_adopt) for p in params if p.requires_grad]

    def changed(self) -> bool:
        """Whether a submodule, parameter, buffer or hook was added, removed or replaced since :meth:`scan`, or a
        parameter or buffer moved to new memory."""
        tables, lengths, *entries = self._tables
        if list(map(len, tables)) != lengths:
            return True
        if entries:
            holders, keys, values = entries
            try:
                if not all(map(operator.is_, map(operator.getitem, holders, keys), values)):
                    return True
            except KeyError:  # a key removed and another added
                return True
        tensors, ptrs = self._tensors
        return list(map(Tensor.data_ptr, tensors)) != ptrs

    def param_copies(self) -> dict[int, Tensor]:
        """With ``copies_params``: ``id(parameter) -> `` the static copy the graphs read instead (a leaf, of the
        parameter's class and ``requires_grad``), one per parameter for every signature of the callable."""
        for p in self.params:
            copy = self._param_copies.get(id(p))
            if copy is None or copy.shape != p.shape or copy.dtype != p.dtype or copy.requires_grad != p.requires_grad:
                copy = p.detach().clone()
                # of the parameter's class, as proxy_leaf makes them: code may check for Parameter
                is_param = isinstance(p, nn.Parameter)
                self._param_copies[id(p)] = (
                    nn.Parameter(copy, p.requires_grad) if is_param else copy.requires_grad_(p.requires_grad)
                )
        return self._param_copies


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
        max_graphs: int | None = None,
        forward_only: bool = False,
        validate: str = "host",
        share_activations: bool = True,
        recompute: bool = False,
        inside_fsdp_units: bool = False,
        name: str | None = None,
    ) -> None:
        if num_warmup_iters < 1:
            raise ValueError(f"num_warmup_iters must be >= 1, got {num_warmup_iters}")
        self.fn = fn
        self.module = _module_of(fn)
        self.group = group
        self.name = name or _name_of(fn)
        # Under FSDP2 the parameters are gathered into new storage for each forward and backward: the graphs read
        # copies of them, refreshed at every call (Entry.load), and an FSDP2 unit's own hooks run eagerly around
        # the replay, so the captured callable is its forward without them.
        self._inside_fsdp_units = inside_fsdp_units
        self.fsdp = _fsdp_role(self.module, self.name, inside_fsdp_units) if self.module is not None else None
        self.copies_params = self.fsdp is not None
        if self.fsdp == "unit" and self.fn is self.module:
            self.fn = self.module.forward
        # A chained stack replays only on the CUDA stream it was recorded on (_check_stream).
        stream = group.recorder.stream
        self._recorded_on = stream if group.chain else None
        policy = group.preparer.buckets
        bound, warn_at = max_graphs, None
        if bound is None and policy is None:
            bound = DEFAULT_MAX_GRAPHS
        elif bound is None:  # a policy bounds the signatures: hold every bucket, evict nothing
            warn_at = 2 * policy.num_buckets
        self.cache: GraphCache[Entry] = GraphCache(
            max_graphs=bound, on_mismatch=on_mismatch, name=self.name, warn_at=warn_at
        )
        self.num_warmup_iters = num_warmup_iters
        self.forward_only = forward_only
        self.debug = validate == "debug"
        self.share_activations = share_activations
        self.recompute = recompute and not forward_only
        self.buffers = SharedBuffers(self, enabled=share_activations)
        self.uid = id(self)
        group.add(self)
        self.recaptures = 0
        self._warned_unchained = False
        self._warned_opaque = False
        registry = group.outputs
        self._chain_of = None if registry is None else (lambda t: registry.lookup(t, self.uid))
        self._device_type = group.recorder.device_type
        self.grad_records: dict[int, Handout] = {}  # id(param) -> the record of the grad last handed out for it
        # Without a storage swap, holders are moved one by one: a hook tells the book which tensor AccumulateGrad
        # adopted as a first .grad (kept by the caller after zero_grad, say).
        adopted = None if forward_only or memory.SWAP_DATA_PTR else functools.partial(_adopted, weakref.ref(self))
        self.tree = ModuleTree(self.module, copies_params=self.copies_params, on_adopt=adopted)

    # ---------------------------------------------------------------- parameters
    @property
    def params(self) -> list[Tensor]:
        """The module's parameters, in module order (each once)."""
        return self.tree.params

    def _frozen(self) -> tuple[int, ...]:
        """Indices of the parameters that do not require grad now (part of the signature). Also checks, on the
        host, that the module tree is the one the graphs were captured from: the same submodules, parameters,
        buffers and hooks, and every parameter and buffer at the same address."""
        if self.tree.changed():
            self._rebind()
        return tuple(i for i, p in enumerate(self.params) if not p.requires_grad)

    def _rebind(self) -> None:
        dropped = self.cache.clear()
        self._let_go(dropped)
        self.buffers.clear()
        self.group.memory.handouts.forget_writer(self.uid)  # the shared buffers' records go with them
        self.tree.scan()
        # A part's parameters swap between shards and gathered tensors at every call; a callable graphed with
        # plain parameters that FSDP2 holds now would read storage FSDP2 frees.
        if self.fsdp is None and self.module is not None:
            role = _fsdp_role(self.module, self.name, self._inside_fsdp_units)
            if role is not None:
                raise RuntimeError(
                    f"{self.name}: FSDP2 (fully_shard) was applied after this callable was graphed; its graphs "
                    "would read parameter storage FSDP2 frees, and were dropped. Apply fully_shard first, then graph "
                    "the model (model.graphed, capture_layers, graph_decoder_layers, graph_transformer_layers)"
                )
        if dropped:
            logger.warning(
                "%s: the module changed since capture: a submodule, parameter, buffer or hook was added, removed or "
                "replaced, or a parameter or buffer moved to new memory (module.to(...), "
                "load_state_dict(assign=True), a reassigned attribute). Its %d graphs replay the old module and were "
                "dropped; new ones are captured at the next calls.",
                self.name,
                len(dropped),
            )

    def param_places(self) -> list[tuple[dict, str, Tensor, int]]:
        return self.tree.places

    def param_copies(self) -> dict[int, Tensor]:
        return self.tree.param_copies()

    def trainable_now(self) -> list[Tensor]:
        """The parameters a capture made now trains: those that require grad (none when forward-only)."""
        return [] if self.forward_only else [p for p in self.params if p.requires_grad]

    def any_in_flight(self) -> bool:
        return any(e.owner is self for e in self.group.memory.pending())

    # ---------------------------------------------------------------- cache
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
        frozen = self._frozen()
        args_key, kwargs_key, dyn = flatten_call(args, kwargs, self.group.preparer, self._chain_of)
        training = None
        if self.tree.submodules:
            flags = tuple(m.training for m in self.tree.submodules)
            # One bool when the whole module agrees (the usual case, and the readable one in error messages).
            training = flags[0] if len(set(flags)) == 1 else flags
        autocast = autocast_state(self._device_type)
        return CallSignature(args_key, kwargs_key, training, autocast, frozen), dyn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fsdp == "unit":
            return call_with_forward(self.module, self._call, *args, **kwargs)
        return self._call(*args, **kwargs)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if self.copies_params:
            self._check_gathered()
        if self._recorded_on is not None:
            self._check_stream()
        key, dyn = self.signature(args, kwargs)
        entry = self.cache.get(key)
        if entry is None:
            entry = self._recapture(key, args, kwargs)
        try:
            return entry.run(dyn)  # the order check comes first: a refused replay has changed nothing
        except GraphOrderError as exc:
            # Graphs of one pool captured in another order than they now run (a stack whose layers' signatures
            # changed at different times: one layer's train/eval flag, a frozen parameter): eager runs the call,
            # so the engine captures it again apart. A graph replayed again before its backward, or one sharing
            # buffers with a pending graph, stays refused.
            if exc.overlap != "pool" or not torch.is_grad_enabled() or not entry.fwd.trains:
                raise
        logger.info("%s: captured again apart: its graph would overwrite a graph whose backward is pending", self.name)
        return self._recapture(entry.key, args, kwargs, apart=True).run(dyn)

    def _check_stream(self) -> None:
        recorded = self._recorded_on
        # Once per layer call: the stream's id, without building a Stream object (torch.cuda.current_stream does)
        ids = getattr(torch._C, "_cuda_getCurrentStream", None)
        if ids is not None and ids(recorded.device_index)[0] == recorded.stream_id:
            return
        current = torch.cuda.current_stream(recorded.device)
        if current != recorded:
            raise RuntimeError(
                f"{self.name}: this chained layer stack was recorded on {self._recorded_on} and is called on "
                f"{current}. A stack recorded from the default stream (on a side stream: CUDA cannot capture on the "
                "default one) and replayed there gave losses that differed from eager's with the GPU busy "
                "(docs/streams.md). Capture the layers and run the whole loop inside one "
                "`with packgraph.graphs.loop_stream(device):` block (packgraph train, the demo, the benchmark and "
                "PackgraphTrainer.train do), or capture with chain=False"
            )

    def _check_gathered(self) -> None:
        sharded = [n for n, p in self.module.named_parameters() if is_dtensor(p)]
        if sharded:
            raise RuntimeError(
                f"{self.name}: called with its parameters still sharded by FSDP2 ({sharded[0]} is a DTensor): FSDP2 "
                "gathers them only inside its unit's forward and backward. Call this graphed part inside the forward "
                "of the FSDP2 unit that holds it, or graph the whole unit (scope 'layer')"
            )

    def _recapture(self, key: CallSignature, args: tuple, kwargs: dict, *, apart: bool = False) -> Entry:
        """Capture the call's signature (new, or with ``apart`` again in a pool of its own, replacing its graph)."""
        if not apart:
            self.cache.check_new(key)
            stack = self._stack_to_recapture()
            if stack is not None:
                return self._recapture_stack(stack, args, kwargs)
        # The backward waits for its first use: captures then follow the order the graphs run in (see
        # Entry.capture_backward_late), and a forward-only use never captures one. Other callables' graphs,
        # captured before, may replay while this one is in flight (the later layers of a stack whose first layer
        # alone has a new signature): it takes a pool of its own.
        apart = apart or any(c is not self and len(c.cache) for c in self.group.callables())
        (entry,) = _capture_stack([self], args, kwargs, backward=False, apart=apart)
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

    def capture_ahead(
        self, shape: Sequence[int], dtype: torch.dtype, requires_grad: bool, *args: Any, **kwargs: Any
    ) -> bool:
        """Capture the chained stack this callable heads for the coming call ``self(x, *args, **kwargs)`` now,
        before the caller computes ``x`` (of ``shape``, ``dtype`` and ``requires_grad``, on this callable's
        device). A new bucket is then captured while only the stack's own input buffer holds a tensor like ``x``,
        not that buffer and ``x`` beside it, at the capture's peak. The buffer (the last call's input) stands in
        for ``x``: a capture runs the layers on its values at warm-up only, and graphs do not depend on them.

        Returns whether it captured. It does nothing where the call would not capture the whole stack (a known
        signature, a call without grad, layers that have seen different signatures: see
        :meth:`_stack_to_recapture`) or where no input buffer of that layout is free; the call then captures as
        it would have. Raises what the call would (invalid PackedSeqParams, ``on_mismatch="error"``).
        """
        if self.copies_params:  # an FSDP2 unit is captured inside its own forward, where it is gathered
            return False
        sample = self.buffers.primary(("input", 0))
        if sample is None or tuple(sample.shape) != tuple(shape) or sample.dtype != dtype:
            return False
        if sample.requires_grad != requires_grad:
            return False
        args = (sample, *args)
        key, _ = self.signature(args, kwargs)
        if key in self.cache:
            return False
        stack = self._stack_to_recapture()
        if stack is None:
            return False
        self.cache.check_new(key)
        self._recapture_stack(stack, args, kwargs)
        return True

    def _stack_to_recapture(self) -> list[GraphedCallable] | None:
        """The chained stack this callable heads, to capture whole at a new signature of a training call.

        A new bucket is new to every layer: captured at the first layer's call, forwards then backwards, its
        capture follows the initial :func:`capture_layers` path instead of a second one, and it runs before the
        head, the loss and their backward allocate. (The capture step's peak is still the last layer's backward
        capture, with every saved activation live, as eager's peak is.) Like the initial capture, it feeds each
        later layer the previous one's output and the first layer's other arguments; a layer called otherwise
        gets its own graph at its call. Only where every layer has been captured as often (stack captures, not
        layer-by-layer ones), and not for calls without grad, which capture forwards only.

        Every layer is captured, also one that already has a graph for its signature (when only the head's is
        new: its input no longer requires grad, say, under a frozen embedding), whose graph the new one
        replaces: the older graph's temporaries may lie where the new head graph's saved activations were
        placed, and it would replay while they are still needed.
        """
        stack = self.group.stack()
        if len(stack) < 2 or stack[0] is not self or self.forward_only or not torch.is_grad_enabled():
            return None
        if any(g.copies_params for g in stack):  # each FSDP2 unit is gathered at its own call only
            return None
        if any(g.captures != self.captures for g in stack):
            return None
        return stack

    def _recapture_stack(self, stack: list[GraphedCallable], args: tuple, kwargs: dict) -> Entry:
        entries = _capture_stack(stack, args, kwargs)
        replaced = any(entry.key in g.cache for g, entry in zip(stack[1:], entries[1:], strict=True))
        for g, entry in zip(stack, entries, strict=True):
            g.recaptures += 1
            g._insert(entry)
        if replaced:
            # The later layers' graphs of these signatures were replaced: only the head's signature changed (a
            # parameter of it frozen, say). The head's older graphs ran with the replaced ones; beside the new ones,
            # captured in the same pool after those graphs' activations went back to it, a replay would overwrite
            # them (GraphOrderError). They go, and a call that needs one captures the stack again, as a new
            # signature does.
            self._drop(e for e in self.cache.values() if e is not entries[0] and not e.in_flight)
        return entries[0]

    def _drop(self, stale: Iterable[Entry]) -> None:
        dropped = self.cache.discard([e.key for e in stale])
        self._let_go(dropped)
        if dropped:
            logger.info("%s: dropped %d graphs that ran with the stack's replaced graphs", self.name, len(dropped))

    def forget(self, entry: Entry) -> None:
        """Drop ``entry`` from the cache (its backward could not be captured)."""
        if self.cache.get(entry.key) is entry:
            self._let_go(self.cache.discard([entry.key]))

    def _let_go(self, entries: list[Entry]) -> None:
        """Entries taken out of the cache (replaced, evicted, dropped): their output tokens and the records of
        what they handed out go, holders moved to memory of their own."""
        memory.let_go_retained(entries, self.name)
        for old in entries:
            old.release()
            self.group.memory.handouts.forget_writer(id(old))
        if entries:
            self.buffers.keep_only(self.cache.values())

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
        kind = "fwd+bwd" if entry.bwd is not None else "fwd, bwd at first use" if entry.fwd.trains else "fwd"
        self._let_go(self.cache.insert(entry.key, entry, seconds=entry.capture_seconds, kind=kind))

    def __repr__(self) -> str:
        return f"GraphedCallable({self.name}, graphs={self.num_graphs}, captures={self.captures})"


def _adopted(owner: weakref.ref, param: Tensor) -> None:
    graphed = owner()
    record = None if graphed is None else graphed.grad_records.get(id(param))
    if record is not None:
        record.adopted(param)


def _remove_hooks(handles: list[torch.utils.hooks.RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _tree_tables(mod: nn.Module) -> list[dict]:
    """The dicts of ``mod`` whose contents the graphs were captured from: its children, parameters, buffers and
    hooks (a hook added after capture would otherwise never run; one removed would keep running)."""
    return [mod._modules, mod._parameters, mod._buffers, *(getattr(mod, n) for n in _HOOK_TABLES if hasattr(mod, n))]


class GraphedOptions(TypedDict, total=False):
    """The options of each :class:`GraphedCallable` (:func:`capture` documents them)."""

    num_warmup_iters: int
    on_mismatch: str
    max_graphs: int | None
    forward_only: bool
    share_activations: bool
    recompute: bool
    inside_fsdp_units: bool


class CaptureOptions(GraphedOptions, total=False):
    """:func:`capture`'s keyword options, which every layer of :func:`capture_layers` takes too."""

    validate: str
    buckets: BucketPolicy | None
    keep_mamba_fields: bool


DEFAULT_MAX_GRAPHS = 8
"""Cache bound of a callable captured without a bucket policy (with one, the policy bounds the signatures)."""


def _module_of(fn: Callable) -> nn.Module | None:
    """The module whose parameters ``fn`` trains: ``fn`` itself, or a bound method's module."""
    owner = getattr(fn, "__self__", None)
    return fn if isinstance(fn, nn.Module) else owner if isinstance(owner, nn.Module) else None


def _name_of(fn: Callable) -> str:
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _capture_stack(
    graphed: Sequence[GraphedCallable], args: tuple, kwargs: dict, *, backward: bool = True, apart: bool = False
) -> list[Entry]:
    """Capture ``x = g(x, *args[1:], **kwargs)`` for each ``g`` in turn: forwards in order, then backwards in
    reverse (the order a model runs them). One callable is the plain single capture. In a chained group each
    layer reads the previous layer's static output in place, and each backward reads the next layer's input-grad
    buffer as its output grad. ``backward=False`` leaves each backward graph to be captured at its first use;
    ``apart`` captures into a pool of their own (:class:`~packgraph.graphs.entry.Entry`)."""
    entries: list[Entry] = []
    started = []
    first = args[0] if args else None
    for k, g in enumerate(graphed):
        if k > 0:
            prev = entries[-1]
            if not prev.fwd.single_output:
                raise ValueError(
                    f"capture_layers: {prev.owner.name} must return one tensor (it becomes the next layer's first "
                    "argument); wrap layers that return more"
                )
            out = prev.fwd.static_outputs[0]
            if not g.group.chain and isinstance(first, Tensor) and out.dtype != first.dtype:
                # Unchained layers each get an input of their own (an attention half: the float32 norm of the
                # residual stream, not the previous attention's bf16 output under autocast): the sample keeps the
                # first one's dtype, which is in the signature, so the first real call replays instead of capturing.
                out = out.to(first.dtype)
            args = (out.detach().requires_grad_(out.requires_grad), *args[1:])
        started.append(time.perf_counter())
        key, dyn = g.signature(args, kwargs)
        entry = Entry(g, key, args, kwargs, dyn, apart=apart)  # warmed up, its forward recorded
        if k + 1 < len(graphed):
            # real values in the output the next layer warms up on; a held output of another signature of this
            # layer (the same buffer) moves first, as at any forward replay
            memory.before_replay(entry, entry.fwd.seq, "forward")
            entry.fwd.graph.replay()
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
        memory.before_capture(entry, release=False)  # as a backward captured at first use does
        with explained_capture_errors(entry):
            entry.capture_backward(given, last_in_stack=k + 1 == len(entries))
        entry.capture_seconds += time.perf_counter() - t0
    return entries


def _make_group(
    recorder: Recorder, *, validate: str, buckets: BucketPolicy | None, keep_mamba_fields: bool, chain: bool
) -> CaptureGroup:
    preparer = ParamsPreparer(validate=validate, buckets=buckets, keep_mamba_fields=keep_mamba_fields)
    return CaptureGroup(recorder, preparer, chain=chain)


def _as_args(sample_args: Any) -> tuple:
    return tuple(sample_args) if isinstance(sample_args, (tuple, list)) else (sample_args,)


def capture_with(
    recorder: Recorder,
    fn_or_module: Callable,
    sample_args: Any,
    sample_kwargs: dict | None = None,
    *,
    validate: str = "host",
    buckets: BucketPolicy | None = None,
    keep_mamba_fields: bool = False,
    **options: Unpack[GraphedOptions],
) -> GraphedCallable:
    """:func:`capture` with an explicit recorder (the protocol is in :mod:`packgraph.graphs.recorder`)."""
    group = _make_group(recorder, validate=validate, buckets=buckets, keep_mamba_fields=keep_mamba_fields, chain=False)
    graphed = GraphedCallable(fn_or_module, group, validate=validate, **options)
    if not graphed.copies_params:  # FSDP2's parameters are gathered only in its forward: captured at first call
        (entry,) = _capture_stack([graphed], _as_args(sample_args), dict(sample_kwargs or {}))
        graphed._insert(entry)
    return graphed


def capture_layers_with(
    recorder: Recorder,
    layers: Sequence[Callable],
    sample_args: Any,
    sample_kwargs: dict | None = None,
    *,
    chain: bool = True,
    validate: str = "host",
    buckets: BucketPolicy | None = None,
    keep_mamba_fields: bool = False,
    **options: Unpack[GraphedOptions],
) -> list[GraphedCallable]:
    """:func:`capture_layers` with an explicit recorder."""
    if not layers:
        raise ValueError("capture_layers needs at least one layer")
    # FSDP2 gathers a unit's parameters only inside its own forward: each layer is then captured at its first call
    # and copies its input (a stack captured at once would need every unit gathered together).
    inside = options.get("inside_fsdp_units", False)
    sharded = any(_fsdp_role(m, _name_of(layer), inside) for layer in layers if (m := _module_of(layer)) is not None)
    group = _make_group(
        recorder, validate=validate, buckets=buckets, keep_mamba_fields=keep_mamba_fields, chain=chain and not sharded
    )
    graphed = [
        GraphedCallable(layer, group, validate=validate, name=f"layer[{k}] {_name_of(layer)}", **options)
        for k, layer in enumerate(layers)
    ]
    if sharded:
        return graphed
    for g, entry in zip(
        graphed, _capture_stack(graphed, _as_args(sample_args), dict(sample_kwargs or {})), strict=True
    ):
        g._insert(entry)
    if chain:
        group.set_stack(graphed)
    return graphed


def capture(
    fn_or_module: Callable,
    sample_args: Any,
    sample_kwargs: dict | None = None,
    *,
    num_warmup_iters: int = 3,
    pool: Pool | None = None,
    on_mismatch: str = "recapture",
    max_graphs: int | None = None,
    forward_only: bool = False,
    buckets: BucketPolicy | None = None,
    validate: str = "host",
    keep_mamba_fields: bool = False,
    share_activations: bool = True,
    recompute: bool = False,
) -> GraphedCallable:
    """Capture ``fn_or_module`` into CUDA graphs (forward, and backward unless ``forward_only``).

    Autograd-exact: outputs, input and parameter grads, and when ``.grad`` changes are eager's. Grads reach
    autograd's ``AccumulateGrad`` (a first grad is adopted without a copy, later ones are added), so
    ``torch.autograd.grad``, ``backward(inputs=)``, parameters frozen or unfrozen after capture, hooks and
    micro-batches behave as in eager; outputs and grads handed out keep their values while held.

    The signature of a call (a new one is a new capture): tensors and PackedSeqParams anywhere in the args are
    dynamic inputs; shapes, dtypes, ``requires_grad``, non-tensor args, the params' static signature,
    ``module.training`` of every submodule, which parameters are frozen and the autocast state are static.

    .. warning:: Refused, naming the fix: double backward, a forward replayed again before its backward.
    .. warning:: Python side effects run at capture only; a tensor hidden in an object or closure is a constant.
    .. warning:: A changed module tree (``module.to``, a reassigned attribute) drops the graphs and recaptures.
    .. warning:: One thread per capture group; a chained stack replays on its recording stream (``loop_stream``).
    .. warning:: Dropout is fresh per replay on the default CUDA generator; register other generators yourself.

    Args:
        fn_or_module: an ``nn.Module`` (its parameters are trained), a bound method of one, or a function.
        sample_args / sample_kwargs: a representative call (a lone tensor may stand for a 1-tuple). Their static
            signature is captured now; other signatures are captured at their first call.
        num_warmup_iters: eager iterations on a side stream before each capture.
        pool: a ``torch.cuda.graph_pool_handle()`` to share with other captures; default a fresh one. In a shared
            pool the grads of idle signatures stay allocated (another group's capture could reuse memory this
            group still hands out).
        on_mismatch: ``"recapture"`` (an LRU cache) or ``"error"`` (:class:`GraphSignatureError`).
        max_graphs: the LRU's bound. Default: every bucket of ``buckets`` is kept (no eviction; a warning when a
            callable holds more than twice as many signatures, since something else static then varies), or 8
            signatures without a policy.
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
        share_activations: let the graphs of every signature share one set of saved activations and static
            buffers (memory of one graph set, however many buckets). Replays must then follow the model's order; a
            replay that would overwrite an unfinished forward raises :class:`~packgraph.graphs.memory.GraphOrderError`.
            ``False`` keeps each signature's memory apart.
        recompute: activation recomputation inside the graphs: the callable runs under
            ``torch.utils.checkpoint`` (non-reentrant), so the forward graph saves only what it reads and the
            backward graph runs the forward again before its own kernels. A stack's saved activations shrink to
            the layers' inputs, and each backward's recomputed activations are its temporaries, which the next
            layer's backward reuses. Refused (``GraphCaptureError``) for a callable that draws random numbers
            (dropout): the recomputed forward would draw other masks than the forward did.

    Returns:
        a :class:`GraphedCallable`.

    Raises:
        RuntimeError: no CUDA device; :class:`~packgraph.host_syncs.GraphCaptureError` when the callable cannot
            be captured (it names the offending line, e.g. a host sync, and the fix).
    """
    recorder = recorder_for(pool, (sample_args, sample_kwargs), "packgraph.capture")
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
        share_activations=share_activations,
        recompute=recompute,
    )


def capture_layers(
    layers: Sequence[Callable],
    sample_args: Any,
    sample_kwargs: dict | None = None,
    *,
    chain: bool = True,
    pool: Pool | None = None,
    **options: Unpack[CaptureOptions],
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
    recorder = recorder_for(pool, (sample_args, sample_kwargs), "packgraph.capture_layers")
    return capture_layers_with(recorder, layers, sample_args, sample_kwargs, chain=chain, **options)
