"""What the model-family tests share: a stand-in recorder that, like a CUDA graph, captures integer indexing."""

import torch

from tests import eager_recorder


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
