"""One capture: static buffers, the forward and backward CUDA graphs of one signature, and the autograd glue.

:class:`Entry` is what a :class:`~packgraph.graphs.capture.GraphedCallable` caches per signature. It is built from a
call (its static buffers are copies of the call's tensors, or, in a chained layer stack, the previous layer's static
output itself), captured by the group's recorder, and replayed inside :class:`Replay`, a ``torch.autograd.Function``
whose backward replays the backward graph.

Parameter grads (``param_grads="graph"``): the backward graph adds each parameter's grad into one persistent buffer per
parameter (shared by every graph that trains it). Before a replay, a parameter whose ``.grad`` is not that buffer is
handled on the host: ``None`` (after ``zero_grad(set_to_none=True)``) zeroes the buffer and makes it ``.grad`` after the
replay; a tensor the caller assigned gets the buffer added to it. In the steady state (``.grad`` is the buffer) a
replay costs one identity check per parameter on the host and no device work beyond the graph.

Memory and replay order. All graphs of a group share one memory pool. Whatever a capture frees goes back to the
pool, where a later capture may place its own tensors: temporaries are always freed at the end of their capture,
and with ``share_activations`` (the default) so are the activations a forward saves for its backward, once the
backward graph is recorded. Graph sets of several signatures (buckets) then hold one set of activations between
them instead of one each. The price is an order rule: replaying a graph recorded at capture number ``s`` may
overwrite (a) anything captured after ``s`` and (b) activations freed before ``s``. Neither matters when a model
runs as it is captured (each forward's backward before the next step's forwards), but it would silently corrupt
a graph whose forward replayed and whose backward has not run yet. The group tracks those entries
(``in_flight``) and :func:`check_replay_order` raises :class:`GraphOrderError` before such a replay.
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from packgraph.graphs import safety
from packgraph.graphs.cache import logger
from packgraph.graphs.signature import (
    CallSignature,
    PreparedParams,
    autocast_state,
    dyn_keys,
    is_chained,
    rebuild_call,
    tensor_requires_grad,
)

if TYPE_CHECKING:
    from packgraph.graphs.capture import GraphedCallable

__all__ = ["Entry", "Replay", "PARAM_GRAD_MODES", "GraphOrderError", "explained_capture_errors"]

PARAM_GRAD_MODES: tuple[str, ...] = ("graph", "autograd")


def _preserve_version(t: Tensor) -> contextlib.AbstractContextManager:
    preserve = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
    return contextlib.nullcontext() if preserve is None else preserve(t)


class GraphOrderError(RuntimeError):
    """A replay would overwrite the saved activations or outputs of a graph whose backward has not run yet."""


# One persistent grad buffer per parameter, shared by every graph that trains it (tied weights, recaptures).
_grad_buffers = WeakIdKeyDictionary()


class Entry:
    """One signature's capture: static buffers, the forward graph and, when training, the backward graph."""

    def __init__(self, owner: GraphedCallable, key: CallSignature, args: tuple, kwargs: dict, dyn: list) -> None:
        self.owner = owner
        self.key = key
        self.flight: Any = None  # weakref to the autograd context of a forward whose backward has not run
        self.warned_pending = False
        self.fwd_seq = 0  # capture numbers in the group (see the module docstring)
        self.bwd_seq: int | None = None
        # A capture made while a graph with freed activations is in flight gets a pool of its own: the group's
        # pool may hand it that graph's activations.
        self.pool: Any = None
        recorder = owner.group.recorder
        if any(o.in_flight and o.activations_freed_at() < math.inf for o in owner.group.in_flight.values()):
            self.pool = recorder.new_pool() if hasattr(recorder, "new_pool") else None
        self.tokens: list[tuple[Tensor, int]] = []
        self.capture_seconds = 0.0
        keys = dyn_keys(key)
        self.load_plan: list[tuple[int, int, Tensor, int]] = []  # (dyn index, params tensor index or -1, buf, ptr)
        self.static_inputs: list[Tensor | None] = []
        self.static_params = []
        substitutes = []
        for i, (item, k) in enumerate(zip(dyn, keys, strict=True)):
            if isinstance(item, PreparedParams):
                bufs = [t.detach().clone() for t in item.tensors]
                self.load_plan += [(i, j, b, b.data_ptr()) for j, b in enumerate(bufs)]
                rebuilt = item.rebuild(bufs)
                self.static_params.append(rebuilt)
                self.static_inputs.append(None)
                substitutes.append(rebuilt)
                continue
            owner.group.recorder.check_input(item)
            if is_chained(k):
                buf = item.detach()  # the producer graph's output itself: read in place, never copied
                producer = owner.group.outputs.producer(item) if i == 0 else None
                if producer is not None:
                    producer.consumer = weakref.ref(self)  # its backward reads our input-grad buffer in place
            else:
                buf = item.detach().clone()
                self.load_plan.append((i, -1, buf, buf.data_ptr()))
            buf.requires_grad_(tensor_requires_grad(k))
            self.static_inputs.append(buf)
            substitutes.append(buf)
        self.chained = any(is_chained(k) for k in keys)
        self.grad_positions = [i for i, k in enumerate(keys) if tensor_requires_grad(k)]
        self.chained_grad_inputs = [is_chained(keys[i]) for i in self.grad_positions]
        self.static_args, self.static_kwargs = rebuild_call(args, kwargs, substitutes)
        self.fwd_graph: Any = None
        self.bwd_graph: Any = None
        self.trains = False  # set by capture_forward: a backward graph is wanted (captured now or at first use)
        self.consumer: Any = None  # weakref to the entry that reads our output in place (chained stacks)
        self.param_pairs: list[tuple[Tensor, Tensor]] = []

    # ---------------------------------------------------------------- capture
    def _call_fn(self) -> Any:
        if self.owner.debug:
            for params in self.static_params:
                params.assert_valid_async()
        return self.owner.fn(*self.static_args, **self.static_kwargs)

    def _grad_targets(self) -> list[Tensor]:
        return [self.static_inputs[i] for i in self.grad_positions] + self.owner.trainable_params

    def warm_up(self) -> None:
        owner = self.owner
        train = not owner.forward_only
        targets = self._grad_targets() if train else []

        def run() -> None:
            with _capture_mode(owner, train):
                out = self._call_fn()
                outs = [o for o in pytree.tree_leaves(out) if isinstance(o, Tensor) and o.requires_grad]
                if outs and targets:
                    grads = [torch.zeros_like(o) for o in outs]
                    torch.autograd.grad(outs, targets, grads, allow_unused=True)

        owner.group.recorder.warmup(run, owner.num_warmup_iters)

    def capture_forward(self) -> None:
        owner = self.owner
        train = not owner.forward_only

        def body() -> list:
            with _capture_mode(owner, train):
                out = self._call_fn()
            leaves, self.out_spec = pytree.tree_flatten(out)
            self.out_template = [_OUT if isinstance(v, Tensor) else v for v in leaves]
            self.raw_outputs = [v for v in leaves if isinstance(v, Tensor)]
            return self.raw_outputs

        self.fwd_graph, self.static_outputs = owner.group.recorder.record(body, pool=self.pool)
        self.fwd_seq = owner.group.next_seq()
        self.single_output = len(self.out_template) == 1 and self.out_template[0] is _OUT
        self.nondiff = [j for j, o in enumerate(self.static_outputs) if not o.requires_grad]
        self.trains = not owner.forward_only and len(self.nondiff) < len(self.static_outputs)
        self.trains = self.trains and bool(self._grad_targets())
        if not self.trains:
            self.nondiff = list(range(len(self.static_outputs)))
        registry = owner.group.outputs
        if registry is not None:
            own = {b.data_ptr() for b in self.static_inputs if b is not None}
            for o in self.static_outputs:
                if o.data_ptr() not in own:
                    self.tokens.append((o, registry.register(o, owner.uid, self)))

    def capture_backward(self, grad_output_buffers: dict[int, Tensor] | None = None) -> None:
        """Record the backward graph. ``grad_output_buffers[j]`` (optional) is read as the grad of output ``j``:
        the next layer's input-grad buffer in a chained stack, so no copy is needed between them."""
        owner = self.owner
        if not self.trains:
            return
        diff = [j for j, o in enumerate(self.static_outputs) if o.requires_grad]
        targets = self._grad_targets()
        given = grad_output_buffers or {}
        self.static_grad_outputs: list[Tensor | None] = [None] * len(self.static_outputs)
        for j in diff:
            self.static_grad_outputs[j] = given.get(j)
            if self.static_grad_outputs[j] is None:
                self.static_grad_outputs[j] = torch.zeros_like(self.static_outputs[j])
        self.grad_plan = [(j, g, g.data_ptr()) for j, g in enumerate(self.static_grad_outputs) if g is not None]
        n_in = len(self.grad_positions)
        params = owner.trainable_params
        in_graph = owner.param_grads == "graph"
        bufs = [_grad_buffer(p) for p in params] if in_graph else []
        pattern: list[bool] = []

        def body() -> list:
            outs = [self.raw_outputs[j] for j in diff]
            grad_outs = [self.static_grad_outputs[j] for j in diff]
            # Without retain_graph the saved activations go back to the pool when this capture ends, and later
            # captures (other signatures) reuse them; retained, they stay this graph's alone. A stand-in recorder
            # that runs the body to record it replays by running it again on the same autograd graph: it keeps it.
            retain = not owner.share_activations or getattr(owner.group.recorder, "records_by_running", False)
            grads = torch.autograd.grad(outs, targets, grad_outs, retain_graph=retain, allow_unused=True)
            pattern[:] = [g is not None for g in grads]
            if in_graph:
                used = [(b, g) for b, g in zip(bufs, grads[n_in:], strict=True) if g is not None]
                if used:
                    torch._foreach_add_([b for b, _ in used], [g for _, g in used])
                return [g for g in grads[:n_in] if g is not None]
            return [g for g in grads if g is not None]

        self.bwd_graph, kept = owner.group.recorder.record(body, pool=self.pool)
        self.bwd_seq = owner.group.next_seq()
        it = iter(kept)
        grads = [next(it) if present else None for present in (pattern[:n_in] if in_graph else pattern)]
        self.static_grad_inputs = grads[:n_in]
        if in_graph:
            self.param_pairs = [(p, b) for p, b, present in zip(params, bufs, pattern[n_in:], strict=True) if present]
        else:
            self.static_param_grads = grads[n_in:]

    def capture_backward_late(self) -> None:
        """Record the backward graph at its first use (inside autograd's backward): a signature first met at call
        time has its forward captured at that call and its backward here, so a chained stack's graphs are
        captured in the order they run (forwards, then backwards in reverse), like the initial capture.

        Capturing the backward at forward time instead would let the next layer's forward capture place its
        static output where this backward keeps temporaries, and this backward (which runs last) would then
        overwrite the stack's output after ``loss.backward()``."""
        consumer = self.consumer() if self.consumer is not None else None
        given = {}
        if consumer is not None and consumer.bwd_graph is not None:
            buf = consumer.grad_input_buffer(0)
            if buf is not None and buf.shape == self.static_outputs[0].shape:
                given[0] = buf
        t0 = time.perf_counter()
        try:
            with explained_capture_errors(self):
                self.capture_backward(given)
        except RuntimeError as exc:
            if "modified by an inplace operation" not in str(exc):
                raise
            raise RuntimeError(
                f"{self.owner.name}: the backward graph of this signature is captured at its first backward, from "
                "the autograd graph recorded at its forward capture; a tensor that forward saved (a weight updated "
                "by optimizer.step(), say) changed in place since. Run the backward of a new signature's first "
                "forward before changing the parameters, or run forwards that need no backward under "
                "torch.no_grad()."
            ) from exc
        self.capture_seconds += time.perf_counter() - t0
        logger.info(
            "%s: captured the backward graph at its first use (%.1f ms)",
            self.owner.name,
            1e3 * (time.perf_counter() - t0),
        )

    @property
    def in_flight(self) -> bool:
        """Its forward replayed with autograd recording and its backward has not run (the graph is still alive)."""
        return self.flight is not None and self.flight() is not None

    def activations_freed_at(self) -> float:
        """The capture number after which this entry's saved activations are free pool memory (inf: never)."""
        if self.bwd_seq is None or not self.owner.share_activations:
            return math.inf
        return self.bwd_seq

    def grad_input_buffer(self, dyn_index: int) -> Tensor | None:
        """The static grad of dynamic input ``dyn_index`` (None if it needs none)."""
        if self.bwd_graph is None or dyn_index not in self.grad_positions:
            return None
        return self.static_grad_inputs[self.grad_positions.index(dyn_index)]

    def release(self) -> None:
        registry = self.owner.group.outputs
        if registry is not None:
            for tensor, token in self.tokens:
                registry.unregister(tensor, token)
        self.tokens = []

    # ---------------------------------------------------------------- replay
    def load(self, dyn: list) -> None:
        keep_versions = self.trains and self.bwd_graph is None
        for i, j, buf, ptr in self.load_plan:
            src = dyn[i] if j < 0 else dyn[i].tensors[j]
            if src.data_ptr() != ptr:
                if keep_versions:
                    # The backward is not captured yet: it will run autograd over the graph recorded at forward
                    # capture, whose saved inputs are these buffers. Refilling them is what graphs are for, not
                    # the in-place change autograd's version check guards against.
                    with _preserve_version(buf):
                        buf.copy_(src)
                else:
                    buf.copy_(src)

    def run(self, dyn: list) -> Any:
        if not self.trains or not torch.is_grad_enabled():
            check_replay_order(self, self.fwd_seq, "forward")
            with torch.no_grad():
                self.load(dyn)
                self.fwd_graph.replay()
            outs = [o.detach() for o in self.static_outputs]
        else:
            grad_tensors = [dyn[i] for i in self.grad_positions]
            if self.owner.param_grads == "autograd":
                grad_tensors += self.owner.trainable_params
            elif not grad_tensors:
                grad_tensors = [self.owner.anchor]  # makes autograd call backward, which writes the param grads
            if self.in_flight and not self.warned_pending:
                self.warned_pending = True
                logger.warning(
                    "%s: forward replayed again before the previous replay's backward ran; that replay's saved "
                    "activations and outputs are overwritten (one forward in flight per graph). Run backward "
                    "first, or call under torch.no_grad() when no backward is intended.",
                    self.owner.name,
                )
            outs = Replay.apply(self, dyn, *grad_tensors)
        if self.single_output:
            return outs[0]
        it = iter(outs)
        return pytree.tree_unflatten([next(it) if v is _OUT else v for v in self.out_template], self.out_spec)

    def replay_backward(self, grads: tuple, stored: list) -> list:
        for j, buf, ptr in self.grad_plan:
            g = grads[j]
            if g is None:
                buf.zero_()  # the output did not reach the loss
            elif g.data_ptr() != ptr:
                buf.copy_(g)
        if self.owner.param_grads == "graph":
            self._replay_accumulating()
            extra: list = [None] if not self.grad_positions else []
        else:
            self.bwd_graph.replay()
            # A param whose grad is None would adopt (steal) the returned tensor as .grad: give it a private copy.
            extra = [
                None if g is None else (g.clone() if p.grad is None else g.detach())
                for p, g in zip(self.owner.trainable_params, self.static_param_grads, strict=True)
            ]
        out = []
        for g, source, chained in zip(self.static_grad_inputs, stored, self.chained_grad_inputs, strict=True):
            if g is None:
                out.append(None)
            elif chained or (source is not None and source.is_leaf and source.grad is not None):
                # The producer graph reads it in place (chained), or autograd adds it into an existing .grad:
                # nothing keeps the static buffer past this backward.
                out.append(g.detach())
            else:
                # Autograd may keep it: as a leaf's first .grad, or through a view/reshape/clone of a leaf, whose
                # backward passes the same storage on to AccumulateGrad. The next replay would overwrite it.
                out.append(g.clone())
        return out + extra

    def _replay_accumulating(self) -> None:
        stale = [(p, b) for p, b in self.param_pairs if p.grad is not b]
        if not stale:
            self.bwd_graph.replay()
            return
        # p.grad is None (zero_grad(set_to_none=True)) or a tensor the caller assigned: the graph accumulates into
        # a zeroed buffer, which then becomes p.grad, or is added to the caller's tensor.
        torch._foreach_zero_([b for _, b in stale])
        self.bwd_graph.replay()
        foreign: list[tuple[Tensor, Tensor]] = []
        for p, b in stale:
            if p.grad is None:
                p.grad = b
            else:
                foreign.append((p.grad, b))
        if foreign:
            torch._foreach_add_([g for g, _ in foreign], [b for _, b in foreign])


@contextlib.contextmanager
def explained_capture_errors(entry: Entry) -> Iterator[None]:
    """Turn a stream-capture failure into a :class:`~packgraph.graphs.safety.GraphCaptureError` naming the line."""
    try:
        yield
    except Exception as exc:
        if not safety.is_capture_error(exc):
            raise
        raise safety.explain_capture_failure(
            exc, entry.owner.fn, entry.static_args, entry.static_kwargs, name=entry.owner.name
        ) from exc


def check_replay_order(entry: Entry, seq: int | None, what: str) -> None:
    """Raise :class:`GraphOrderError` if replaying ``entry``'s graph recorded at capture number ``seq`` could
    overwrite memory of a graph of the group whose backward has not run yet (module docstring)."""
    flights = entry.owner.group.in_flight
    if not flights:
        return
    for key, other in list(flights.items()):
        if other is entry or other.pool is not entry.pool:
            continue
        if not other.in_flight:  # its autograd graph was dropped: its backward will never run
            del flights[key]
            continue
        if seq is not None and (other.fwd_seq > seq or other.activations_freed_at() < seq):
            raise GraphOrderError(
                f"{entry.owner.name}: replaying this {what} graph now could overwrite the saved activations or "
                f"outputs of {other.owner.name} (a graph of the same memory pool, captured at another time), "
                "whose forward ran and whose backward has not. Run that backward first, wrap forwards that need "
                "no backward in torch.no_grad(), or capture with share_activations=False (each signature keeps "
                "its own activations: more memory, fewer such conflicts)."
            )


_OUT = object()  # marks a tensor slot in an output template


def _grad_buffer(p: Tensor) -> Tensor:
    buf = _grad_buffers.get(p)
    if buf is not None and buf.shape == p.shape and buf.dtype == p.dtype and buf.device == p.device:
        return buf
    g = p.grad
    if g is not None and g.shape == p.shape and g.dtype == p.dtype and g.stride() == p.stride():
        buf = g  # accumulate straight into the caller's grad tensor
    else:
        buf = torch.zeros_like(p, memory_format=torch.preserve_format)
    _grad_buffers[p] = buf
    return buf


@contextlib.contextmanager
def _capture_mode(owner: GraphedCallable, train: bool) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad() if train else torch.no_grad())
        device_type = owner.group.recorder.device_type
        dtype = autocast_state(device_type)
        if dtype is not None:
            # A cached cast of a weight would be baked into the graph and go stale after optimizer.step().
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=False))
        yield


class Replay(torch.autograd.Function):
    """Replays an entry's forward graph; its backward replays the backward graph."""

    @staticmethod
    def forward(ctx: Any, entry: Entry, dyn: list, *grad_tensors: Tensor) -> tuple[Tensor, ...]:
        check_replay_order(entry, entry.fwd_seq, "forward")
        entry.load(dyn)
        entry.fwd_graph.replay()
        entry.flight = weakref.ref(ctx)
        entry.owner.group.in_flight[id(entry)] = entry
        ctx.entry = entry
        ctx.set_materialize_grads(False)
        n_in = len(entry.grad_positions)
        ctx.stored = [t if (t.is_leaf or t.retains_grad) else None for t in grad_tensors[:n_in]]
        outs = tuple(o.detach() for o in entry.static_outputs)
        if entry.nondiff:
            ctx.mark_non_differentiable(*[outs[j] for j in entry.nondiff])
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Tensor) -> tuple:
        entry = ctx.entry
        entry.flight = None
        entry.owner.group.in_flight.pop(id(entry), None)
        if entry.bwd_graph is None:
            entry.capture_backward_late()
        check_replay_order(entry, entry.bwd_seq, "backward")
        return (None, None, *entry.replay_backward(grads, ctx.stored))
