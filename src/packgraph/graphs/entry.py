"""One capture: static buffers, the forward and backward CUDA graphs of one signature, and the autograd glue.

:class:`Entry` is what a :class:`~packgraph.graphs.capture.GraphedCallable` caches per signature. It is built
captured: its constructor makes the static buffers from a call (copies of the call's tensors, the callable's shared
buffers, or in a chained stack the previous layer's static output itself), warms up and records the forward graph
(:class:`ForwardGraph`). Its one later state is the backward graph (:class:`BackwardGraph`, ``Entry.bwd``), recorded
right after the forward by a stack capture or at its first use. It replays inside :class:`Replay`, a
``torch.autograd.Function`` whose inputs are the call's tensors that require grad and the parameters trained at
capture, and whose backward replays the backward graph.

Gradients go through autograd, as in eager: :meth:`Entry.replay_backward` returns views of the backward graph's
static grads, and autograd's own ``AccumulateGrad`` adopts each as ``p.grad`` when that is None (no copy), adds it
otherwise, runs the hooks, and skips the parameters a backward does not reach. Which memory those views live in,
and what happens to them at the next replay, is :mod:`packgraph.graphs.memory`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.autograd.function import FunctionCtx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from packgraph import host_syncs
from packgraph.graphs import memory
from packgraph.graphs.cache import logger
from packgraph.graphs.memory import (
    COPIED_OUTPUT_BYTES,
    Handout,
    Pool,
    fits,
    freed_at,
    preserve_version,
)
from packgraph.graphs.recorder import Graph, capture_mode, parameters_replaced, proxy_leaf
from packgraph.graphs.signature import (
    CallSignature,
    PreparedParams,
    dyn_keys,
    is_chained,
    rebuild_call,
    tensor_requires_grad,
)

if TYPE_CHECKING:
    from packgraph.graphs.capture import GraphedCallable

__all__ = ["BackwardGraph", "Entry", "ForwardGraph", "Replay", "explained_capture_errors"]


_OUT = object()  # marks a tensor slot in an output template
# Whether the running backward keeps its graph (``retain_graph=True``); None in a torch without it.
_KEEP_GRAPH: Callable[[], bool] | None = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


@dataclasses.dataclass(eq=False)
class ForwardGraph:
    """An entry's forward graph, its capture number, and how each replay hands its outputs out."""

    graph: Graph
    seq: int  # capture number in the group (packgraph.graphs.memory)
    out_spec: pytree.TreeSpec
    out_template: list[Any]  # the output's leaves, _OUT where a tensor goes
    # the callable's own output tensors at capture: the autograd graph a backward capture differentiates (None where
    # nothing will: they were temporaries copied into the shared buffers)
    raw_outputs: list[Tensor | None]
    static_outputs: list[Tensor]  # where each replay leaves them
    nondiff: list[int]  # outputs marked non-differentiable
    trains: bool  # a backward graph is wanted: recorded after the forward, or at its first use
    out_records: list[Handout]
    copied_outputs: set[int]  # small outputs no graph reads in place, handed out as copies (COPIED_OUTPUT_BYTES)

    @property
    def single_output(self) -> bool:
        return len(self.out_template) == 1 and self.out_template[0] is _OUT


@dataclasses.dataclass(eq=False)
class BackwardGraph:
    """An entry's backward graph, its capture number, and where its grads come in and go out."""

    graph: Graph
    seq: int
    static_grad_outputs: list[Tensor | None]  # read as the grads of the outputs
    grad_plan: list[tuple[int, Tensor, int]]  # (output, its grad buffer, the buffer's address): loaded per replay
    static_grad_inputs: list[Tensor | None]  # grads of the inputs that require grad, in order
    grad_records: list[Handout | None]  # per grad handed out (inputs', then parameters'); None: never released
    chain_records: dict[int, Handout]  # input-grad index -> the stack's chained grad buffer it writes
    grad_output_records: list[Handout]  # the chained grad buffer it reads its output's grad from
    # output -> the chained grad buffer it reads that output's grad from in place, moved off before a copy into it
    read_chain: dict[int, Handout] = dataclasses.field(default_factory=dict)


class Entry:
    """One signature's capture, built captured: static buffers and the forward graph (``fwd``); when training,
    the backward graph (``bwd``: None until recorded, see the module docstring).

    Its life: ``bwd`` is recorded right after the forward (a stack's capture) or at the first backward
    (:meth:`capture_backward_late`; if that fails the entry leaves its cache), never when ``fwd.trains`` is False.
    A call under grad leaves it *pending* (:attr:`in_flight`) until its backward runs. A backward run with
    ``retain_graph`` leaves it *retained* (:func:`~packgraph.graphs.memory.retain`) until a replay or capture may
    write what it reads, when it keeps its own activations (``share_activations=False``); with shared ones a
    second backward is refused. It ends when its callable lets go of it (evicted, replaced or dropped).

    Raises:
        GraphCaptureError: the callable cannot be captured (the line that failed is named).
    """

    def __init__(
        self, owner: GraphedCallable, key: CallSignature, args: tuple, kwargs: dict, dyn: list, *, apart: bool = False
    ) -> None:
        self.owner = owner
        self.key = key
        self.trainable: list[Tensor] = owner.trainable_now()
        # warm-up and capture train these instead of the parameters (packgraph.graphs.recorder says why)
        self.proxies = [proxy_leaf(p) for p in self.trainable]
        self.replaced = dict(zip(map(id, self.trainable), self.proxies, strict=True))
        # FSDP2: every parameter is read from a static copy, refreshed by each call's load (GraphedCallable)
        self.param_loads: list[tuple[Tensor, Tensor]] = []
        if owner.copies_params:
            self.replaced = owner.param_copies()
            self.proxies = [self.replaced[id(p)] for p in self.trainable]
            self.param_loads = [(p, self.replaced[id(p)]) for p in owner.params]
        recorder = owner.group.recorder
        # A capture gets a pool of its own when it is made while a graph with freed activations is in flight (the
        # group's pool may hand it that graph's activations), or ``apart``: when graphs captured before it may
        # replay while it is in flight (their temporaries may lie where its activations are placed).
        self.pool: Pool | None = recorder.pool
        if apart or any(freed_at(o) < float("inf") for o in owner.group.memory.pending()):
            self.pool = recorder.new_pool()
        # A new signature's capture writes the callable's shared buffers before any replay (the call's inputs are
        # loaded into them below; a stand-in recorder's capture writes its outputs): what is handed out on them
        # moves to memory of its own first.
        owner.group.memory.handouts.settle_writer(owner.uid)
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
                self.static_params.append(item.rebuild_packgraph(bufs))  # debug-mode checks run on these
                self.static_inputs.append(None)
                substitutes.append(item.rebuild(bufs))
                continue
            recorder.check_input(item)
            if is_chained(k):
                # The producer graph's output itself, read in place, never copied (the item may be a view handed
                # out of it, whose handle the engine must not hold).
                buf = owner.group.outputs.static(item).detach()
                producer = owner.group.outputs.producer(item)
                if producer is not None and i == 0:
                    producer.consumer = weakref.ref(self)  # its backward reads our input-grad buffer in place
            else:
                buf = owner.buffers.get(("input", i), item)
                self.load_plan.append((i, -1, buf, buf.data_ptr()))
            buf.requires_grad_(tensor_requires_grad(k))
            self.static_inputs.append(buf)
            substitutes.append(buf)
        self.chained = any(is_chained(k) for k in keys)
        self.grad_positions = [i for i, k in enumerate(keys) if tensor_requires_grad(k)]
        self.chained_grad_inputs = [is_chained(keys[i]) for i in self.grad_positions]
        self.static_args, self.static_kwargs = rebuild_call(args, kwargs, substitutes)
        self.consumer: weakref.ref[Entry] | None = None  # the entry that reads our output in place (chained stacks)
        self.bwd: BackwardGraph | None = None
        with explained_capture_errors(self):
            self._warm_up()
            self.fwd = self._capture_forward()

    # ---------------------------------------------------------------- capture
    def _call_fn(self) -> Any:
        if self.owner.debug:
            for params in self.static_params:
                params.assert_valid_async()
        if self.owner.recompute and torch.is_grad_enabled():
            # The forward saves only what the callable reads; the backward runs it again (inside its graph, when
            # captured), proxies and all. No RNG state is kept: warm_up refuses callables that draw numbers.
            return checkpoint(self._run_fn, use_reentrant=False, preserve_rng_state=False)
        return self._run_fn()

    def _run_fn(self) -> Any:
        with parameters_replaced(self.owner, self.replaced):
            return self.owner.fn(*self.static_args, **self.static_kwargs)

    def _grad_targets(self) -> list[Tensor]:
        return [self.static_inputs[i] for i in self.grad_positions] + self.proxies

    def statics(self) -> list[Tensor]:
        """Every static tensor this entry hands out (outputs and grads)."""
        grads = [] if self.bwd is None else [r.static for r in self.bwd.grad_records if r is not None]
        return [r.static for r in self.fwd.out_records] + grads

    def _warm_up(self) -> None:
        owner = self.owner
        train = not owner.forward_only
        targets = self._grad_targets() if train else []
        memory.before_capture(self, release=True)
        if owner.buffers.weights_warmed:
            # An earlier capture of this callable already ran every weight-grad kernel (their shapes do not depend
            # on the signature): warming up input grads alone keeps a second set of parameter grads off the peak.
            targets = targets[: len(self.grad_positions)]

        def run() -> None:
            with capture_mode(owner, train):
                out = self._call_fn()
                outs = [o for o in pytree.tree_leaves(out) if isinstance(o, Tensor) and o.requires_grad]
                if outs and targets:
                    grads = [torch.zeros_like(o) for o in outs]
                    torch.autograd.grad(outs, targets, grads, allow_unused=True)

        checked = not (owner.recompute and train)

        def first_checked() -> None:
            nonlocal checked
            if checked:
                return run()
            checked = True
            with _RandomDraws() as draws:
                run()
            if draws.ops:
                raise host_syncs.GraphCaptureError(
                    f"{owner.name}: recompute=True, but the callable draws random numbers ({', '.join(draws.ops)}): "
                    "the backward graph's recomputed forward would draw other values than the forward did (dropout "
                    "masks, say), so its grads would not be eager's. Set dropout to 0 in the recomputed layers, or "
                    "capture them without recompute.",
                    [],
                    None,
                )

        owner.group.recorder.warmup(first_checked, owner.num_warmup_iters, pool=self.pool)

    def _capture_forward(self) -> ForwardGraph:
        owner = self.owner
        train = not owner.forward_only
        own_inputs = {b.data_ptr() for b in self.static_inputs if b is not None}
        traced: dict[str, Any] = {}

        def body() -> list:
            with capture_mode(owner, train):
                out = self._call_fn()
            leaves, traced["spec"] = pytree.tree_flatten(out)
            traced["template"] = [_OUT if isinstance(v, Tensor) else v for v in leaves]
            raw = traced["raw"] = [v for v in leaves if isinstance(v, Tensor)]
            if hasattr(self, "fwd"):  # a stand-in recorder replays by running the body again: these are the outputs
                self.fwd.raw_outputs = list(raw)
            # An output that is one of the inputs (or a view of one) must stay what it is: never copied elsewhere.
            if any(o.data_ptr() in own_inputs for o in raw):
                return raw
            return owner.buffers.write("output", raw)

        graph, static_outputs = owner.group.recorder.record(body, pool=self.pool)
        seq = owner.group.memory.next_seq()
        raw_outputs: list[Tensor | None] = traced["raw"]
        owner.buffers.free_copied(raw_outputs, static_outputs)
        nondiff = [j for j, o in enumerate(traced["raw"]) if not o.requires_grad]
        trains = not owner.forward_only and len(nondiff) < len(raw_outputs) and bool(self._grad_targets())
        if not trains:
            nondiff = list(range(len(static_outputs)))
            raw_outputs = _only_static(raw_outputs, static_outputs)
        out_records = [
            owner.buffers.record(o, seq=seq, pool=self.pool, name=f"output {j} of {owner.name}")
            for j, o in enumerate(static_outputs)
        ]
        registry = owner.group.outputs
        if registry is not None:
            for o in static_outputs:
                if o.data_ptr() in own_inputs:
                    continue
                if registry.registered(o):  # the primary's buffer, shared: this graph writes it now
                    registry.set_producer(o, self)
                else:
                    self.tokens.append((o, registry.register(o, owner.uid, self)))
        copied_outputs = {
            j
            for j, o in enumerate(static_outputs)
            if o.untyped_storage().nbytes() <= COPIED_OUTPUT_BYTES
            and o.data_ptr() not in own_inputs
            and (registry is None or not registry.registered(o))
        }
        return ForwardGraph(
            graph,
            seq,
            traced["spec"],
            traced["template"],
            raw_outputs,
            static_outputs,
            nondiff,
            trains,
            out_records,
            copied_outputs,
        )

    def capture_backward(
        self, grad_output_buffers: dict[int, Tensor] | None = None, *, last_in_stack: bool = False
    ) -> None:
        """Record the backward graph. ``grad_output_buffers[j]`` (optional) is read as the grad of output ``j``:
        the next layer's input-grad buffer in a chained stack, so no copy is needed between them. The last layer of
        a chained stack (``last_in_stack``) reads the grad of its output from one of the stack's two chained grad
        buffers (:mod:`packgraph.graphs.memory`)."""
        owner, fwd, mem = self.owner, self.fwd, self.owner.group.memory
        if not fwd.trains:
            return
        mem.chain_buffers.lend()
        raw = [o for o in fwd.raw_outputs if o is not None]
        if len(raw) < len(fwd.raw_outputs):
            raise RuntimeError(f"{owner.name}: a backward graph is recorded once, from the forward's autograd graph")
        diff = [j for j, o in enumerate(raw) if o.requires_grad]
        targets = self._grad_targets()
        given = grad_output_buffers or {}
        static_grad_outputs: list[Tensor | None] = [None] * len(raw)
        grad_output_records: list[Handout] = []
        for j in diff:
            static_grad_outputs[j] = given.get(j)
            if static_grad_outputs[j] is None and j == 0 and last_in_stack and owner.group.chain:
                record = mem.chain_buffers.for_stack_output(raw[0])
                static_grad_outputs[0] = record.static
                grad_output_records.append(record)
            if static_grad_outputs[j] is None:
                static_grad_outputs[j] = owner.buffers.get(("grad_output", j), raw[j], zero=True)
        grad_plan = [(j, g, g.data_ptr()) for j, g in enumerate(static_grad_outputs) if g is not None]
        chain_statics = {id(r.static): r for r in mem.chain_buffers.records()}
        read_chain = {j: chain_statics[id(g)] for j, g in enumerate(static_grad_outputs) if id(g) in chain_statics}
        pattern: list[bool] = []
        n_in = len(self.grad_positions)
        pairs = zip(self.grad_positions, self.chained_grad_inputs, strict=True)
        chained = {i: self.static_inputs[i] for i, c in pairs if c}
        by_position = mem.chain_buffers.for_backward(chained, static_grad_outputs)
        chain = {k: by_position[i] for k, i in enumerate(self.grad_positions) if i in by_position}
        for record in [*chain.values(), *grad_output_records]:
            # What is handed out on the buffers this graph writes (the output grad it is about to read, say) moves
            # first: a recorder that records by running the body writes them now.
            mem.handouts.settle_writer(record.writer)
        # Without retain_graph the saved activations go back to the pool when this capture ends, and later captures
        # (other signatures) reuse them; retained, they stay this graph's alone. A stand-in recorder that runs the
        # body to record it replays by running it again on the same autograd graph: it keeps it.
        retain = not owner.share_activations or owner.group.recorder.records_by_running

        def body() -> list:
            # Parameter grads and unchained input grads are each signature's own (written, never zeroed or
            # accumulated into), released to the pool once idle (packgraph.graphs.memory). A chained input grad
            # goes into one of the stack's two chained grad buffers (ChainGradBuffers.for_backward).
            outs = [fwd.raw_outputs[j] for j in diff]  # a stand-in's replay re-runs the forward: its latest
            grad_outs = [static_grad_outputs[j] for j in diff]
            grads = list(torch.autograd.grad(outs, targets, grad_outs, retain_graph=retain, allow_unused=True))
            pattern[:] = [g is not None for g in grads]
            for k, record in chain.items():
                g = grads[k]
                if g is not None and fits(g, record.static):
                    with torch.no_grad(), preserve_version(record.static):
                        record.static.copy_(g)
                    grads[k] = record.static
                    chain_records[k] = record
            return [g for g in grads if g is not None]

        chain_records: dict[int, Handout] = {}
        graph, kept = owner.group.recorder.record(body, pool=self.pool)
        seq = mem.next_seq()
        if not retain:
            fwd.raw_outputs = _only_static(fwd.raw_outputs, fwd.static_outputs)
        it = iter(kept)
        grads = [next(it) if present else None for present in pattern]
        owner.buffers.weights_warmed = owner.buffers.weights_warmed or any(g is not None for g in grads[n_in:])
        grad_records = self._grad_records(grads, seq)
        self.bwd = BackwardGraph(
            graph,
            seq,
            static_grad_outputs,
            grad_plan,
            grads[:n_in],
            grad_records,
            chain_records,
            grad_output_records,
            read_chain,
        )

    def _grad_records(self, grads: list[Tensor | None], seq: int) -> list[Handout | None]:
        """A :class:`~packgraph.graphs.memory.Handout` for each backward result the caller receives, tracked for
        release when idle. A chained input grad (read in place by the producer graph's backward: a chained grad
        buffer, or this graph's own result if its layout fits none) is never released: its slot is None."""
        owner, n_in = self.owner, len(self.grad_positions)
        records: list[Handout | None] = []
        for k, g in enumerate(grads):
            if g is None or (k < n_in and self.chained_grad_inputs[k]):
                records.append(None)
                continue
            what = f"grad of input {self.grad_positions[k]}" if k < n_in else "parameter grad"
            params = () if k < n_in else (self.trainable[k - n_in],)
            name = f"{what} of {owner.name}"
            record = Handout(g, seq=seq, writer=id(self), pool=self.pool, name=name, params=params)
            owner.group.memory.handouts.track(record)
            records.append(record)
        return records

    def capture_backward_late(self) -> None:
        """Record the backward graph at its first use (inside autograd's backward): a signature first met at call
        time has its forward captured at that call and its backward here, so a chained stack's graphs are
        captured in the order they run (forwards, then backwards in reverse), like the initial capture.

        Capturing the backward at forward time instead would let the next layer's forward capture place its
        static output where this backward keeps temporaries, and this backward (which runs last) would then
        overwrite the stack's output after ``loss.backward()``."""
        memory.before_capture(self, release=False)
        consumer = self.consumer() if self.consumer is not None else None
        given = {}
        if consumer is not None and consumer.bwd is not None:
            buf = consumer.grad_input_buffer(0)
            if buf is not None and buf.shape == self.fwd.static_outputs[0].shape:
                given[0] = buf
        t0 = time.perf_counter()
        try:
            with explained_capture_errors(self):
                self.capture_backward(given, last_in_stack=consumer is None)
        except BaseException as exc:
            # The autograd graph of the forward capture is spent: the next call of this signature captures anew.
            self.owner.forget(self)
            if not isinstance(exc, RuntimeError) or "modified by an inplace operation" not in str(exc):
                raise
            raise RuntimeError(
                f"{self.owner.name}: the backward graph of this signature is captured at its first backward, from "
                "the autograd graph recorded at its forward capture; a tensor that forward saved (a module buffer "
                "written in place, by load_state_dict say) changed since. This call's backward cannot run; the "
                "signature's graphs were dropped, and its next call captures them again."
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
        pending = self.owner.group.memory.in_flight.get(id(self))
        return pending is not None and pending[1]() is not None

    def grad_input_buffer(self, dyn_index: int) -> Tensor | None:
        """The static grad of dynamic input ``dyn_index``, when a graph captured later may read it in place: only
        a chained one (pinned; a released one may share its memory with that graph's). None otherwise."""
        if self.bwd is None or dyn_index not in self.grad_positions:
            return None
        k = self.grad_positions.index(dyn_index)
        return self.bwd.static_grad_inputs[k] if self.bwd.grad_records[k] is None else None

    def release(self) -> None:
        registry = self.owner.group.outputs
        if registry is not None:
            live = [e for e in self.owner.cache.values() if e is not self]
            for tensor, token in self.tokens:
                if not any(o is tensor for e in live for o in e.fwd.static_outputs):  # another signature's output
                    registry.unregister(tensor, token)
        self.tokens = []

    # ---------------------------------------------------------------- replay
    def load(self, dyn: list) -> None:
        keep_versions = self.fwd.trains and self.bwd is None
        for param, copy in self.param_loads:
            if param.data_ptr() != copy.data_ptr():
                # Refilling a copy is what it is for; autograd's version check of a late backward capture guards
                # against other writes.
                with torch.no_grad(), preserve_version(copy):
                    copy.copy_(param)
        for i, j, buf, ptr in self.load_plan:
            src = dyn[i] if j < 0 else dyn[i].tensors[j]
            if src.data_ptr() != ptr:
                if keep_versions:
                    # The backward is not captured yet: it will run autograd over the graph recorded at forward
                    # capture, whose saved inputs are these buffers. Refilling them is what graphs are for, not
                    # the in-place change autograd's version check guards against.
                    with preserve_version(buf):
                        buf.copy_(src)
                else:
                    buf.copy_(src)

    def hand_out_outputs(self) -> list[Tensor]:
        book, copied = self.owner.group.memory.handouts, self.fwd.copied_outputs
        records = self.fwd.out_records
        return [r.static.detach().clone() if j in copied else book.hand_out(r) for j, r in enumerate(records)]

    def run(self, dyn: list) -> Any:
        fwd = self.fwd
        if not fwd.trains or not torch.is_grad_enabled():
            if self.owner.forward_only and torch.is_grad_enabled():
                self._refuse_grad(dyn)
            memory.before_replay(self, fwd.seq, "forward")
            with torch.no_grad():
                self.load(dyn)
                fwd.graph.replay()
            outs = self.hand_out_outputs()
        else:
            grad_tensors = [dyn[i] for i in self.grad_positions] + self.trainable
            outs = Replay.apply(self, dyn, *grad_tensors)
        if fwd.single_output:
            return outs[0]
        it = iter(outs)
        return pytree.tree_unflatten([next(it) if v is _OUT else v for v in fwd.out_template], fwd.out_spec)

    def _refuse_grad(self, dyn: list) -> None:
        wants = [t for t in dyn if isinstance(t, Tensor) and t.requires_grad]
        if wants or any(p.requires_grad for p in self.owner.params):
            raise RuntimeError(
                f"{self.owner.name}: captured with forward_only=True (no backward graph) and called with grad enabled "
                f"on {'an input that requires' if wants else 'parameters that require'} grad: eager's output would "
                "require grad, this one cannot. Call it under torch.no_grad() (scoring, eval), or capture without "
                "forward_only."
            )

    def replay_backward(self, bwd: BackwardGraph, grads: tuple) -> list:
        book = self.owner.group.memory.handouts
        for j, buf, ptr in bwd.grad_plan:
            g = grads[j]
            if g is None:
                buf.zero_()  # the output did not reach the loss
            elif g.data_ptr() != ptr:
                read = bwd.read_chain.get(j)
                if read is not None:  # a grad handed out on it (kept by a hook, say) keeps its values
                    book.settle_writer(read.writer)
                buf.copy_(g)
        bwd.graph.replay()
        n_in = len(self.grad_positions)
        out: list[Tensor | None] = []
        for k, record in enumerate(bwd.grad_records):
            if k in bwd.chain_records:
                # The producer graph reads it in place; tracked, as the next chained backward overwrites it.
                out.append(book.hand_out(bwd.chain_records[k]))
            elif record is None:
                # Chained but not in the shared buffer (another layout): read in place; or no grad.
                chained = bwd.static_grad_inputs[k] if k < n_in else None
                out.append(chained.detach() if chained is not None else None)
            elif k < n_in and not memory.SWAP_DATA_PTR:
                # autograd may keep an input's grad where holders cannot be moved one by one (memory.py, handouts)
                out.append(record.static.clone())
            else:
                if k >= n_in:  # whose adopted .grad the owner's hook reports, without a swap
                    self.owner.grad_records[id(self.trainable[k - n_in])] = record
                # AccumulateGrad adopts it as a first .grad or adds it into one; another op's backward reads it.
                # Whatever keeps it keeps the record's handle, which the next replay that writes it settles.
                out.append(book.hand_out(record))
        return out


@contextlib.contextmanager
def explained_capture_errors(entry: Entry) -> Iterator[None]:
    """Turn a stream-capture failure into a :class:`~packgraph.host_syncs.GraphCaptureError` naming the line."""
    try:
        yield
    except Exception as exc:
        if not host_syncs.is_capture_error(exc):
            raise
        raise host_syncs.explain_capture_failure(
            exc, entry.owner.fn, entry.static_args, entry.static_kwargs, name=entry.owner.name
        ) from exc


def _only_static(raw: list[Tensor | None], static: list[Tensor]) -> list[Tensor | None]:
    """The raw outputs that are static ones, None for the rest: once nothing will differentiate them, raw outputs
    copied into the shared buffers by the forward graph are temporaries, whose memory goes back to the pool."""
    return [r if r is s else None for r, s in zip(raw, static, strict=True)]


class _RandomDraws(TorchDispatchMode):
    """Names the ops of a run that draw random numbers (tagged ``nondeterministic_seeded`` and not switched off by
    a zero dropout probability, as attention kernels with ``dropout_p=0`` are)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            named = dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | kwargs
            off = named.get("dropout_p", named.get("p", 1)) == 0 or named.get("train", True) is False
            if not off and str(func) not in self.ops:
                self.ops.append(str(func))
        return func(*args, **kwargs)


def _param_versions(entry: Entry) -> list[int]:
    """The version counters of the parameters the graphs read (FSDP2's copies are refilled at each call)."""
    return [] if entry.owner.copies_params else [p._version for p in entry.owner.params]


class Replay(torch.autograd.Function):
    """Replays an entry's forward graph; its backward replays the backward graph.

    Inputs: the entry, the call's dynamic inputs, then (as autograd inputs) the call's tensors that require grad
    and the parameters the entry trains, so autograd routes, accumulates and hooks their grads as in eager.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, entry: Entry, dyn: list, *grad_tensors: Tensor) -> tuple[Tensor, ...]:
        memory.before_replay(entry, entry.fwd.seq, "forward")
        entry.load(dyn)
        entry.fwd.graph.replay()
        entry.owner.group.memory.in_flight[id(entry)] = (entry, weakref.ref(ctx))
        ctx.entry = entry
        ctx.versions = _param_versions(entry)
        ctx.set_materialize_grads(False)
        outs = tuple(entry.hand_out_outputs())
        if entry.fwd.nondiff:
            ctx.mark_non_differentiable(*[outs[j] for j in entry.fwd.nondiff])
        return outs

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: Tensor) -> tuple:
        entry = ctx.entry
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{entry.owner.name}: backward with create_graph=True (double backward, e.g. a gradient penalty) "
                "reached a graphed callable; its backward is a replayed CUDA graph and cannot be differentiated. "
                "Run this callable eagerly for such losses."
            )
        overwritten_by = getattr(ctx, "overwritten_by", None)
        if overwritten_by is not None:
            raise RuntimeError(
                f"{entry.owner.name}: a second backward through this call's autograd graph (retain_graph=True), "
                f"after {overwritten_by}. Capture with share_activations=False (each graph keeps its activations, "
                "and a retained backward runs again until another call of its capture group writes them), or run "
                "this callable eagerly."
            )
        if _param_versions(entry) != ctx.versions:
            # Eager raises here for a weight its backward saved; the backward graph would read the new values.
            raise RuntimeError(
                f"{entry.owner.name}: a parameter of this graphed call changed in place since its forward (an "
                "optimizer.step() or a load_state_dict before the backward, say): its backward would read the new "
                "values. Run the backward before changing the parameters, as eager needs for the weights it saves."
            )
        entry.owner.group.memory.in_flight.pop(id(entry), None)
        entry.owner.group.memory.chain_buffers.lend()
        if entry.bwd is None:
            entry.capture_backward_late()
        bwd = entry.bwd
        assert bwd is not None  # capture_backward records it when fwd.trains, which Replay needs
        memory.before_replay(entry, bwd.seq, "backward")
        grads_out = entry.replay_backward(bwd, grads)
        if _KEEP_GRAPH is None or _KEEP_GRAPH():  # unknown: as if retained (a second backward then checks)
            if entry.owner.share_activations:
                # Recorded without retain_graph, the backward graph let go of each activation once read and reused
                # its memory later in the same graph: its replay overwrites what a second replay would read. Every
                # recorder refuses it alike (the eager stand-in keeps that memory; op-replay overwrites it as CUDA may).
                ctx.overwritten_by = "its first backward, whose graph reuses the memory of the activations it read"
            else:
                memory.retain(entry, ctx)
        return (None, None, *grads_out)
