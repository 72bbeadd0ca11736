"""Call signatures: everything a captured graph bakes in, computed cheaply on every call. Pure Python, no CUDA.

A call ``graphed(*args, **kwargs)`` is split into

* **dynamic inputs** (``dyn``): every tensor found in the args and kwargs (containers are walked with
  ``torch.utils._pytree``), and every :class:`~packgraph.params.PackedSeqParams`, as a :class:`PreparedParams`
  whose tensors are the graph inputs. Their *values* change per call; they are copied into static buffers.
* a **signature** (:class:`CallSignature`), hashable, that a graph is valid for: the call structure, each
  tensor's shape, dtype, device and ``requires_grad`` (plus, for inputs read in place from another graph's
  output, which output: see ``chain_of``), each PackedSeqParams' static signature and which of its fields share
  one tensor (the attention kernel's switch, ``short_docs_min_slots``, among its static fields), the non-tensor
  values, ``module.training`` and the autocast state.

Order is fixed: positional args in order, then kwargs sorted by name, each walked depth-first in pytree order.
:func:`rebuild_call` walks the same order to put static buffers in the place of the dynamic inputs.

PackedSeqParams go through a :class:`ParamsPreparer` first: validation (before anything is copied), the bucket
mapping and ``attention_view``. Its result is cached per params *object* (keyed on ``id`` and checked against
the object's fields and its tensors' version counters), so a model that passes one params object to N layers
validates and buckets it once.

**Explained.** Signatures explained: the human-readable form of a leaf key and the list of fields where two
signatures differ, for logs and for the errors of ``on_mismatch="error"``. Never on the replay path.
"""

from __future__ import annotations

import operator
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from packgraph.params import (
    DYNAMIC_FIELDS,
    GroupIdentity,
    PackedSeqParams,
    ParamsType,
    StaticSignature,
    params_type_of,
    tensor_version,
)

if TYPE_CHECKING:
    from packgraph.buckets import BucketPolicy

__all__ = [
    "CallSignature",
    "ParamsKey",
    "ParamsPreparer",
    "PreparedParams",
    "StaticKey",
    "TensorKey",
    "TreeKey",
    "VALIDATE_MODES",
    "describe_key",
    "flatten_call",
    "rebuild_call",
    "signature_diff",
]


# --------------------------------------------------------------------------------------------------------- signatures
VALIDATE_MODES: tuple[str, ...] = ("host", "sync", "debug", "off")

_PARAM_FIELDS = (*DYNAMIC_FIELDS, "seq_idx")


class CallSignature(NamedTuple):
    """The static signature of one call. Hashable; equal signatures can share a graph.

    ``frozen``: indices (in module order) of the parameters that did not require grad: a graph trains exactly the
    others, so freezing or unfreezing one after capture selects another graph. (The attention kernel's switch,
    ``short_docs_min_slots``, is in the params' static signature.)
    """

    args: tuple
    kwargs: tuple
    training: bool | None
    autocast: torch.dtype | None
    frozen: tuple[int, ...] = ()


class TensorKey(NamedTuple):
    """A tensor leaf of a signature. ``source`` and ``strides`` are set for an input read in place from another
    graph's static output (``source`` names that output): the graph reads that memory, so they are baked in."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    source: int | None = None
    strides: tuple[int, ...] | None = None


class TreeKey(NamedTuple):
    """A container leaf: its pytree structure and the keys of its leaves."""

    spec: _Spec
    leaves: tuple[Key, ...]


class StaticKey(NamedTuple):
    """A non-tensor value, keyed with its type (1, 1.0 and True hash alike but may trace differently); an
    unhashable value is keyed by identity (:class:`~packgraph.params.GroupIdentity`)."""

    type: type
    value: Any


# Leaf keys are built per tensor per call on the replay path: ``tuple.__new__`` makes them without the Python-level
# ``__new__`` that NamedTuple generates.
_new = tuple.__new__


class ParamsKey:
    """A PackedSeqParams' :class:`StaticSignature`, which fields share one tensor (``aliases``) and the params class
    the callable receives (``kind``: packgraph's, or a registered foreign one such as Megatron's), hashable.

    The hash is computed once: the key is reused for every call with the same params object.
    """

    __slots__ = ("signature", "aliases", "kind", "_hash")

    def __init__(self, signature: StaticSignature, aliases: tuple[tuple[str, ...], ...], kind: type) -> None:
        self.signature = signature
        self.aliases = aliases
        self.kind = kind
        self._hash = hash((signature, aliases, kind))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return (
            isinstance(other, ParamsKey)
            and self._hash == other._hash
            and self.kind is other.kind
            and self.aliases == other.aliases
            and self.signature == other.signature
        )

    def __repr__(self) -> str:
        return f"ParamsKey({self.signature}, aliases={self.aliases}, kind={self.kind.__qualname__})"


class _Spec:
    """A pytree ``TreeSpec`` in a signature: hashable whatever the torch version's ``TreeSpec`` offers."""

    __slots__ = ("spec", "_hash")

    def __init__(self, spec: pytree.TreeSpec) -> None:
        self.spec = spec
        try:
            self._hash = hash(spec)
        except TypeError:
            self._hash = hash(str(spec))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Spec) and self._hash == other._hash and self.spec == other.spec

    def __repr__(self) -> str:
        return str(self.spec)


Key: TypeAlias = TensorKey | TreeKey | StaticKey | ParamsKey
"""One leaf of a signature (``CallSignature.args`` and ``kwargs`` hold these)."""


class PreparedParams:
    """A PackedSeqParams ready for a graph: validated, bucketed, reduced to what the graph may see.

    Attributes:
        params: the prepared params (rebuilt on static buffers, they are what the captured callable sees).
        key: their :class:`ParamsKey`.
        tensors: the distinct tensors of ``params`` in field order: the graph inputs.
        fields: for each of ``tensors``, the field names that hold it.
        foreign: the :class:`~packgraph.params.ParamsType` of the caller's class when it is not packgraph's
            (the callable then receives that class again).
    """

    __slots__ = (
        "params",
        "key",
        "tensors",
        "fields",
        "foreign",
        "_source",
        "_values",
        "_versions",
        "_source_tensors",
        "_cpu_values",
    )

    def __init__(
        self, source: object, params: PackedSeqParams, converted: PackedSeqParams, foreign: ParamsType | None = None
    ) -> None:
        groups: dict[int, list[str]] = {}
        tensors: list[Tensor] = []
        for name in _PARAM_FIELDS:
            t = getattr(params, name)
            if t is None:
                continue
            if id(t) not in groups:
                groups[id(t)] = []
                tensors.append(t)
            groups[id(t)].append(name)
        self.params = params
        self.tensors = tuple(tensors)
        self.fields = tuple(tuple(groups[id(t)]) for t in tensors)
        self.foreign = foreign
        self.key = ParamsKey(params.static_signature(), self.fields, type(source))
        self._source = weakref.ref(source)
        self._values = tuple(vars(source).values())
        self._source_tensors = tuple({id(t): t for t in converted.graph_inputs().values()}.values())
        self._versions = _versions(self._source_tensors)
        # A write through .numpy() or .data keeps the version: on the CPU the values tell it, at no sync.
        cpu = [t for t in self._source_tensors if t.device.type == "cpu"]
        self._cpu_values = (cpu, [t.clone() for t in cpu])

    def is_current_for(self, source: object) -> bool:
        """True when ``source`` is the object this was prepared from, with no field reassigned and no tensor
        modified in place since (version counters; and values, for CPU tensors). Tensors with no version counter
        never match."""
        if self._source() is not source or self._versions is None:
            return False
        if not all(map(operator.is_, vars(source).values(), self._values)):
            return False
        return _versions(self._source_tensors) == self._versions and all(map(torch.equal, *self._cpu_values))

    def rebuild(self, buffers: Sequence[Tensor]) -> Any:
        """The prepared params on ``buffers`` (one per entry of ``tensors``), as the captured callable sees them:
        a :class:`~packgraph.params.PackedSeqParams`, or the caller's foreign class."""
        params = self.rebuild_packgraph(buffers)
        return params if self.foreign is None else self.foreign.from_packgraph(params)

    def rebuild_packgraph(self, buffers: Sequence[Tensor]) -> PackedSeqParams:
        """:meth:`rebuild` as packgraph's own class, whatever the caller's."""
        inputs = {name: buf for names, buf in zip(self.fields, buffers, strict=True) for name in names}
        return PackedSeqParams.from_graph_inputs(inputs, self.key.signature)


def _versions(tensors: Sequence[Tensor]) -> tuple[int, ...] | None:
    versions = tuple(tensor_version(t) for t in tensors)
    return None if None in versions else versions  # inference tensors have no version counter


class ParamsPreparer:
    """Validates, buckets and trims PackedSeqParams before they reach a graph; caches the result per object.

    Args:
        validate: ``"host"`` checks values from ``host_offsets`` (no sync; device-only params get the structural
            checks), ``"sync"`` also checks device-only params with one device-to-host read per new params
            object, ``"debug"`` is ``"host"`` here (the engine adds ``torch._assert_async`` checks inside the
            graph), ``"off"`` checks nothing.
        buckets: a ``BucketPolicy`` (anything with ``apply(params) -> params``): params are re-padded to their
            bucket before the signature is taken.
        keep_mamba_fields: keep ``total_tokens``/``seq_idx``; by default ``attention_view()`` drops them so they
            neither enter the graph nor force a recapture when they change.
        cache_size: how many recent params objects to remember.

    Validation runs on the caller's params, before the bucket mapping and before anything is copied into a
    graph's static buffers, so a rejected call leaves every graph as it was.
    """

    def __init__(
        self,
        *,
        validate: str = "host",
        buckets: BucketPolicy | None = None,
        keep_mamba_fields: bool = False,
        cache_size: int = 8,
    ) -> None:
        if validate not in VALIDATE_MODES:
            raise ValueError(f"validate must be one of {VALIDATE_MODES}, got {validate!r}")
        self.validate = validate
        self.buckets = buckets
        self.keep_mamba_fields = keep_mamba_fields
        self.cache_size = cache_size
        self._cache: OrderedDict[int, PreparedParams] = OrderedDict()

    def __call__(self, params: object) -> PreparedParams:
        """``params``: a :class:`~packgraph.params.PackedSeqParams` or an instance of a registered foreign class
        (converted at the boundary, tensors shared: no copy, no sync)."""
        prepared = self._cache.get(id(params))
        if prepared is not None and prepared.is_current_for(params):
            return prepared
        prepared = self._prepare(params)
        self._cache[id(params)] = prepared
        self._cache.move_to_end(id(params))
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return prepared

    def _prepare(self, source: object) -> PreparedParams:
        foreign = None if isinstance(source, PackedSeqParams) else params_type_of(source)
        params = source if foreign is None else foreign.to_packgraph(source)
        if self.validate != "off":
            params.validate(sync=self.validate == "sync")
        out = params
        if self.buckets is not None:
            out = self.buckets.apply(out)  # ValueError when no bucket fits: its message says which ladder
        if not self.keep_mamba_fields:
            out = out.attention_view()
        return PreparedParams(source, out, params, foreign)


# --------------------------------------------------------------------------------------------- flattening
def _is_container(x: object) -> bool:
    return isinstance(x, (tuple, list, dict)) or type(x) in pytree.SUPPORTED_NODES


def _static_key(x: object) -> StaticKey | None:
    if x is None:
        return None
    try:
        hash(x)
    except TypeError:
        return _new(StaticKey, (type(x), GroupIdentity(x)))
    return _new(StaticKey, (type(x), x))


def flatten_call(
    args: tuple,
    kwargs: Mapping[str, Any],
    prepare: Callable[[PackedSeqParams], PreparedParams],
    chain_of: Callable[[Tensor], int | None] | None = None,
) -> tuple[tuple, tuple, list]:
    """``(args_key, kwargs_key, dyn)`` for one call (see the module docstring).

    Args:
        prepare: maps each PackedSeqParams to its :class:`PreparedParams` (may raise: validation).
        chain_of: optional; for a tensor, a token naming the other graph's static output it *is* (same memory),
            or None. Such an input is read in place by the graph, so the token, the shape and the strides go
            into its key.
    """
    dyn: list = []
    args_key = tuple([_leaf_or_tree(a, dyn, prepare, chain_of) for a in args])
    if not kwargs:
        return args_key, (), dyn
    kwargs_key = tuple([(k, _leaf_or_tree(kwargs[k], dyn, prepare, chain_of)) for k in sorted(kwargs)])
    return args_key, kwargs_key, dyn


def is_params(x: object) -> bool:
    """Whether ``x`` is split like PackedSeqParams: packgraph's class or a registered foreign one."""
    return isinstance(x, PackedSeqParams) or (type(x) not in _PLAIN and params_type_of(x) is not None)


_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, slice})


def _leaf_or_tree(x: object, dyn: list, prepare: Callable, chain_of: Callable | None) -> Key | None:
    if isinstance(x, Tensor):
        dyn.append(x)
        if chain_of is not None:
            token = chain_of(x)
            if token is not None:
                return _new(TensorKey, (x.shape, x.dtype, x.device, x.requires_grad, token, x.stride()))
        return _new(TensorKey, (x.shape, x.dtype, x.device, x.requires_grad, None, None))
    if is_params(x):
        prepared = prepare(x)
        dyn.append(prepared)
        return prepared.key
    if _is_container(x):
        leaves, spec = pytree.tree_flatten(x)
        return _new(TreeKey, (_Spec(spec), tuple([_leaf(leaf, dyn, prepare, chain_of) for leaf in leaves])))
    return _static_key(x)


def _leaf(x: object, dyn: list, prepare: Callable, chain_of: Callable | None) -> Key | None:
    if isinstance(x, Tensor) or is_params(x):
        return _leaf_or_tree(x, dyn, prepare, chain_of)
    return _static_key(x)


def rebuild_call(args: tuple, kwargs: Mapping[str, Any], substitutes: Sequence[Any]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with each dynamic input replaced, in :func:`flatten_call` order, by ``substitutes``.

    Used at capture time only (it is not on the replay path).
    """
    it = iter(substitutes)
    new_args = tuple(_rebuild(a, it) for a in args)
    new_kwargs = {k: _rebuild(kwargs[k], it) for k in sorted(kwargs)}
    if next(it, _END) is not _END:
        raise ValueError("rebuild_call: more substitutes than dynamic inputs")
    return new_args, new_kwargs


_END = object()


def _rebuild(x: Any, it: Iterator) -> Any:
    if isinstance(x, Tensor) or is_params(x):
        return next(it)
    if _is_container(x):
        leaves, spec = pytree.tree_flatten(x)
        return pytree.tree_unflatten([next(it) if isinstance(v, Tensor) or is_params(v) else v for v in leaves], spec)
    return x


def tensor_requires_grad(key: Key) -> bool:
    """Whether a leaf key describes a tensor that requires grad."""
    return isinstance(key, TensorKey) and key.requires_grad


def is_chained(key: Key) -> bool:
    """Whether a leaf key describes a tensor read in place from another graph's static output."""
    return isinstance(key, TensorKey) and key.source is not None


def _leaves(signature: CallSignature) -> Iterator[tuple[str, Key]]:
    """Every leaf key of a signature with its path (``args[0].leaf[1]``), in ``dyn`` order."""

    def visit(path: str, key: Key) -> Iterator[tuple[str, Key]]:
        if isinstance(key, TreeKey):
            for j, leaf in enumerate(key.leaves):
                yield from visit(f"{path}.leaf[{j}]", leaf)
        else:
            yield path, key

    for i, key in enumerate(signature.args):
        yield from visit(f"args[{i}]", key)
    for name, key in signature.kwargs:
        yield from visit(f"kwargs[{name!r}]", key)


def dyn_keys(signature: CallSignature) -> list[TensorKey | ParamsKey]:
    """The leaf keys of the dynamic inputs, in ``dyn`` order (tensors and params only)."""
    return [key for _, key in _leaves(signature) if isinstance(key, (ParamsKey, TensorKey))]


def identity_statics(signature: CallSignature) -> list[str]:
    """Paths of static values keyed by identity (unhashable objects): a new object is a new signature."""
    return [
        f"{path} ({key.type.__name__})"
        for path, key in _leaves(signature)
        if isinstance(key, StaticKey) and isinstance(key.value, GroupIdentity)
    ]


def autocast_state(device_type: str) -> torch.dtype | None:
    """The autocast state a graph bakes in for ``device_type``: None when off, else the autocast dtype."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


# ---------------------------------------------------------------------------------------------------------- explained
def describe_key(key: Key | None) -> str:
    """A short human-readable form of one leaf key (used in logs and error messages)."""
    if key is None:
        return "None"
    if isinstance(key, ParamsKey):
        sig = key.signature
        return (
            f"PackedSeqParams(max_seqlen_q={sig.max_seqlen_q}, max_seqlen_kv={sig.max_seqlen_kv}, "
            f"capacity={sig.capacity}, total_tokens={sig.total_tokens})"
        )
    if isinstance(key, TensorKey):
        chained = f", reads graph output #{key.source}" if key.source is not None else ""
        return f"Tensor({tuple(key.shape)}, {key.dtype}, {key.device}, requires_grad={key.requires_grad}{chained})"
    if isinstance(key, TreeKey):
        node = key.spec.spec.type
        return f"{getattr(node, '__name__', 'tree')} of {len(key.leaves)} leaves"
    if isinstance(key.value, GroupIdentity):
        return f"{key.type.__name__} object @ {id(key.value.obj):#x}"
    return f"{key.type.__name__} {key.value!r}"


def signature_diff(captured: CallSignature, given: CallSignature) -> list[tuple[str, Any, Any]]:
    """``[(field, captured_value, given_value), ...]`` for every field that differs between two signatures.

    Field names read like code: ``args[0].shape``, ``args[1].max_seqlen_q``, ``kwargs['causal']``,
    ``module.training``, ``autocast``, ``args[1].short_docs_min_slots``.
    """
    out: list[tuple[str, Any, Any]] = []
    if len(captured.args) != len(given.args):
        out.append(("number of positional args", len(captured.args), len(given.args)))
    for i, (a, b) in enumerate(zip(captured.args, given.args, strict=False)):
        _diff_key(f"args[{i}]", a, b, out)
    ck, gk = dict(captured.kwargs), dict(given.kwargs)
    for name in sorted(set(ck) | set(gk)):
        if name not in ck or name not in gk:
            out.append(
                (
                    f"kwargs[{name!r}]",
                    describe_key(ck[name]) if name in ck else "<absent>",
                    describe_key(gk[name]) if name in gk else "<absent>",
                )
            )
        else:
            _diff_key(f"kwargs[{name!r}]", ck[name], gk[name], out)
    if captured.training != given.training:
        out.append(("module.training", captured.training, given.training))
    if captured.autocast != given.autocast:
        out.append(("autocast", captured.autocast or "off", given.autocast or "off"))
    if captured.frozen != given.frozen:
        out.append(("frozen parameters", captured.frozen, given.frozen))
    return out


_TENSOR_PARTS = ("shape", "dtype", "device", "requires_grad")


def _diff_key(path: str, a: Key, b: Key, out: list) -> None:
    if a == b:
        return
    if isinstance(a, ParamsKey) and isinstance(b, ParamsKey):
        for field, x, y in a.signature.diff(b.signature):
            out.append((f"{path}.{field}", x, y))
        if a.aliases != b.aliases:
            out.append((f"{path}.shared tensors", a.aliases, b.aliases))
        return
    if isinstance(a, TensorKey) and isinstance(b, TensorKey):
        for part in _TENSOR_PARTS:
            x, y = getattr(a, part), getattr(b, part)
            if x != y:
                out.append((f"{path}.{part}", tuple(x) if part == "shape" else x, tuple(y) if part == "shape" else y))
        if (a.source, a.strides) != (b.source, b.strides):
            out.append((f"{path}.source", _source(a), _source(b)))
        return
    if isinstance(a, TreeKey) and isinstance(b, TreeKey):
        if a.spec != b.spec:
            out.append((f"{path}.structure", str(a.spec), str(b.spec)))
            return
        for j, (x, y) in enumerate(zip(a.leaves, b.leaves, strict=True)):
            _diff_key(f"{path}.leaf[{j}]", x, y, out)
        return
    out.append((path, describe_key(a), describe_key(b)))


def _source(key: TensorKey) -> str:
    return f"graph output #{key.source} (strides {key.strides})" if key.source is not None else "a tensor copied in"
