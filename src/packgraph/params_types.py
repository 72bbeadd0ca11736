"""The registry of foreign packed-sequence params classes the graph engine splits like packgraph's own.

A foreign class (Megatron's ``PackedSeqParams``) is registered with :func:`register_params_type`; the engine looks
instances up with :func:`params_type_of`. Known foreign classes are recognised before their integration module is
imported: the first lookup imports it, and the module registers the class.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from packgraph.params import PackedSeqParams

__all__ = ["ParamsType", "params_type_of", "register_params_type"]


class ParamsType(NamedTuple):
    """How the engine carries another library's packed-sequence params class (Megatron's) across a graph boundary.

    ``to_packgraph(obj)`` returns a :class:`PackedSeqParams` sharing ``obj``'s tensors (no copies, no syncs);
    ``from_packgraph(params)`` builds an instance of the foreign class from packgraph params, again sharing tensors.
    """

    to_packgraph: Callable[[Any], PackedSeqParams]
    from_packgraph: Callable[[PackedSeqParams], Any]


_PARAMS_TYPES: dict[type, ParamsType] = {}
# Qualified class name -> the integration module that registers it on import.
_KNOWN_FOREIGN = {"megatron.core.packed_seq_params.PackedSeqParams": "packgraph.integrations.megatron"}
# Classes already looked up and found unregistered, so a lookup on every call costs one set probe.
_NOT_PARAMS: set[type] = set()


def register_params_type(
    cls: type, *, to_packgraph: Callable[[Any], PackedSeqParams], from_packgraph: Callable[[PackedSeqParams], Any]
) -> None:
    """Let ``capture``/``capture_layers`` split instances of ``cls`` like :class:`PackedSeqParams` (see
    :class:`ParamsType`). The captured callable then receives an instance of ``cls`` rebuilt on static buffers."""
    _PARAMS_TYPES[cls] = ParamsType(to_packgraph, from_packgraph)
    _NOT_PARAMS.discard(cls)


def params_type_of(obj: Any) -> ParamsType | None:
    """The registered :class:`ParamsType` of ``obj``'s class (importing its integration on first sight), or None."""
    cls = type(obj)
    found = _PARAMS_TYPES.get(cls)
    if found is None and cls not in _NOT_PARAMS:
        module = _KNOWN_FOREIGN.get(f"{cls.__module__}.{cls.__qualname__}")
        if module is not None:
            importlib.import_module(module)
            found = _PARAMS_TYPES.get(cls)
        if found is None:
            _NOT_PARAMS.add(cls)
    return found
