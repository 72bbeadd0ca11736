"""Signatures explained: the human-readable form of a leaf key and the list of fields where two signatures differ,
for logs and for the errors of ``on_mismatch="error"``. Never on the replay path."""

from __future__ import annotations

from typing import Any

from packgraph.graphs.signature import CallSignature, ParamsKey, TensorKey, TreeKey
from packgraph.params import GroupIdentity

__all__ = ["describe_key", "signature_diff"]


def describe_key(key: Any) -> str:
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
    ``module.training``, ``autocast``, ``slot_boundary.SHORT_DOCS_MIN_SLOTS``.
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
    if captured.short_docs != given.short_docs:
        out.append(("slot_boundary.SHORT_DOCS_MIN_SLOTS", captured.short_docs, given.short_docs))
    return out


_TENSOR_PARTS = ("shape", "dtype", "device", "requires_grad")


def _diff_key(path: str, a: Any, b: Any, out: list) -> None:
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
