"""What the model-family tests share: pytest params per family (marked while ``varlen_attention`` lacks a keyword a
family needs) and a stand-in recorder that, like a CUDA graph, captures integer indexing.
"""

import inspect

import pytest
import torch

from packgraph.integrations.hf_families import FAMILIES, Family
from packgraph.ops import varlen_attention
from tests import eager_recorder

OPS_KEYWORDS = frozenset(inspect.signature(varlen_attention).parameters)


def needed_keywords(family: Family) -> list[str]:
    """The ``varlen_attention`` keywords the family's attention passes (its documents are longer than its window)."""
    features = {"window": family.windowed, "softcap": "softcap" in family.features, "sinks": "sinks" in family.features}
    return [k for k, used in features.items() if used]


def missing_keywords(family: Family) -> list[str]:
    return [k for k in needed_keywords(family) if k not in OPS_KEYWORDS]


def family_param(name: str, *values):
    """``pytest.param(name, *values)``, an expected failure while ``varlen_attention`` lacks a keyword it needs."""
    missing = missing_keywords(FAMILIES[name])
    marks = []
    if missing:
        reason = (
            f"packgraph.ops.varlen_attention has no {', '.join(missing)} keyword yet (the ops change that adds window, "
            f"softcap and sinks has not landed); {FAMILIES[name].title} passes it"
        )
        marks.append(pytest.mark.xfail(reason=reason, strict=True))
    return pytest.param(name, *values, marks=marks, id="-".join([name, *map(str, values)]))


def family_params():
    return [family_param(name) for name in FAMILIES]


# ---------------------------------------------------------------------------------------------------- stand-in
class _Untagged:
    """An aten op seen without its tags (same schema, same call)."""

    def __init__(self, op):
        self.op, self._schema, self.tags = op, op._schema, ()

    def __call__(self, *args, **kwargs):
        return self.op(*args, **kwargs)

    def __repr__(self):
        return repr(self.op)


class _IntegerIndexRecording(eager_recorder._OpRecording):
    """``aten.index.Tensor`` is tagged dynamic-output-shape because a boolean index needs ``nonzero``; with integer
    indices its output shape is the indices' and CUDA runs it without reading anything on the host, so a CUDA graph
    captures it (MoE experts gather tokens and expert weights that way)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.index.Tensor and all(
            i is None or i.dtype not in (torch.bool, torch.uint8) for i in args[1]
        ):
            func = _Untagged(func)
        return super().__torch_dispatch__(func, types, args, kwargs)


class IntegerIndexOpReplayRecorder(eager_recorder.OpReplayRecorder):
    """:class:`~tests.eager_recorder.OpReplayRecorder`, but integer indexing is captured as a CUDA graph captures it
    (the op-replay stand-in refuses every ``aten.index.Tensor``); boolean indexing and every other host read are
    still refused."""

    def record(self, body, pool=None):
        plain = eager_recorder._OpRecording
        eager_recorder._OpRecording = _IntegerIndexRecording
        try:
            return super().record(body, pool)
        finally:
            eager_recorder._OpRecording = plain
