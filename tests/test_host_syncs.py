"""Host-sync diagnostics (packgraph.host_syncs) on the CPU: frames, fixes, the warning recorder.

The real detector needs CUDA (tests/cuda/test_host_syncs_cuda.py); here the pieces it is built from are checked
with stand-ins: an object whose ``.tolist()`` raises the CUDA capture error, and a CPU op that warns on every call
in place of torch's sync warning.
"""

import functools
import inspect

import pytest
import torch

from packgraph.graphs import GraphCaptureError, HostSync, find_host_syncs
from packgraph.host_syncs import (
    _SyncRecorder,
    explain_capture_failure,
    failing_frame,
    is_capture_error,
    suggest_fixes,
)

CAPTURE_ERROR = "CUDA error: operation not permitted when stream is capturing"


class _CapturingOffsets:
    """Stands in for cu_seqlens during a capture: reading it on the host fails the way CUDA does, from C (no
    Python frame of its own, like a tensor method)."""

    tolist = item = functools.partial(torch._assert_async, torch.tensor(False), CAPTURE_ERROR)

    def max(self):
        return self


def unsafe_rope_thd(x, cu_seqlens):
    """Megatron's unfused THD RoPE pattern: positions from a host-side walk over cu_seqlens."""
    offsets = cu_seqlens.tolist()  # UNSAFE-ROPE
    return x, offsets


def attention_with_dynamic_max(q, cu_seqlens):
    max_seqlen = int(cu_seqlens.max().item())  # UNSAFE-MAX
    return q, max_seqlen


def _line_of(fn, marker):
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if marker in line)


def _failed_capture(fn, *args):
    """An exception shaped like a failed capture: capture_end's error raised while the user's error propagates."""
    try:
        try:
            fn(*args)
        finally:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    except RuntimeError as exc:
        return exc


def test_failing_frame_names_the_users_line_through_the_exception_chain():
    exc = _failed_capture(unsafe_rope_thd, None, _CapturingOffsets())
    assert "previous error" in str(exc) and CAPTURE_ERROR in str(exc.__context__)
    found = failing_frame(exc)
    assert found.filename == __file__
    assert found.lineno == _line_of(unsafe_rope_thd, "UNSAFE-ROPE")
    assert found.function == "unsafe_rope_thd" and "cu_seqlens.tolist()" in found.code
    assert CAPTURE_ERROR in found.op and found.stack[-1].endswith(f":{found.lineno} in unsafe_rope_thd")


def test_explanation_names_the_line_and_the_fix():
    exc = _failed_capture(unsafe_rope_thd, None, _CapturingOffsets())
    err = explain_capture_failure(exc, unsafe_rope_thd, (), {}, name="rope", rerun=False)
    assert isinstance(err, GraphCaptureError) and isinstance(err, RuntimeError)
    msg = str(err)
    assert f"{__file__}:{_line_of(unsafe_rope_thd, 'UNSAFE-ROPE')}" in msg
    assert "could not capture rope" in msg and "apply_rope_thd" in msg
    # The first line names what broke the capture, not the capture_end error raised after it.
    assert msg.splitlines()[0] == f"could not capture rope into a CUDA graph: {CAPTURE_ERROR}"
    exc = _failed_capture(attention_with_dynamic_max, None, _CapturingOffsets())
    err = explain_capture_failure(exc, attention_with_dynamic_max, (), {}, rerun=False)
    assert err.location.lineno == _line_of(attention_with_dynamic_max, "UNSAFE-MAX")
    assert "pass max_seqlen statically" in str(err)


def test_capture_errors_are_recognised():
    assert is_capture_error(_failed_capture(unsafe_rope_thd, None, _CapturingOffsets()))
    assert is_capture_error(RuntimeError("CUDA error: operation not permitted when stream is capturing"))
    assert not is_capture_error(RuntimeError("CUDA out of memory"))
    assert not is_capture_error(ValueError("capture"))  # only runtime (CUDA) errors


def test_fix_suggestions_follow_the_code():
    def sync(code, op="aten._local_scalar_dense.default"):
        return HostSync(op, "/m/model.py", 3, "forward", code)

    assert "max_seqlen statically" in suggest_fixes(sync("m = int(cu.max().item())"))[0]
    assert "apply_rope_thd" in suggest_fixes(sync("pos = cu.tolist()"))[0]
    assert "data-dependent shapes" in suggest_fixes(sync("idx = mask.nonzero()", op="aten.nonzero.default"))[0]
    assert "keep the value on the device" in suggest_fixes(sync("if loss.item() > 3:"))[0]
    assert "smaller part" in suggest_fixes(sync("y = helper(x)"))[0]
    assert str(sync("y = helper(x)")) == "/m/model.py:3 in forward: y = helper(x)  [aten._local_scalar_dense.default]"


def _warns_on_every_call(a):
    out = torch.empty(a.numel() + 2)
    return torch.add(a, a, out=out)  # WARNS: torch resizes a non-empty out= tensor, with a C++ warning


def test_sync_recorder_tracks_op_and_frame(monkeypatch):
    # The recorder's CUDA part (sync debug mode) is a no-op here; a C++ warning stands in for the sync warning.
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    a = torch.ones(3)
    with _SyncRecorder(match="was resized") as recorder:
        for _ in range(3):
            _warns_on_every_call(a)
        a.sum()  # an op that does not warn
    (found,) = recorder.syncs.values()
    assert found.op == "aten.add.out" and found.count == 3
    assert found.filename == __file__ and found.lineno == _line_of(_warns_on_every_call, "WARNS")
    assert found.function == "_warns_on_every_call"


def test_find_host_syncs_needs_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="find_host_syncs needs a CUDA device"):
        find_host_syncs(lambda: None)
