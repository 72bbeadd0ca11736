"""The host-sync detector on a real GPU: it names the unsafe line, capture() explains its failure, and the
graph-safe ops have no syncs at all."""

import inspect
import os

import pytest
import torch
from torch import nn

from packgraph.graphs import GraphCaptureError, capture, find_host_syncs
from packgraph.ops import apply_rope_thd, varlen_attention
from packgraph.params import PackedSeqParams

T, H, HD = 256, 4, 32
DEV = "cuda"


def unsafe_rope_thd(x: torch.Tensor, params: PackedSeqParams, base: float = 10000.0) -> torch.Tensor:
    """THD RoPE the way Megatron's unfused path did it: split the stream per sequence on the host."""
    offsets = params.cu_seqlens_q.tolist()  # HOST-SYNC: reads cu_seqlens on the host
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    pieces = []
    for start, end in zip(offsets[:-1], offsets[1:], strict=True):
        pos = torch.arange(end - start, device=x.device, dtype=torch.float32)
        angles = torch.cat([pos[:, None] * inv_freq] * 2, dim=-1)[:, None, :]
        seg = x[start:end].float()
        rotated = torch.cat([-seg[..., d // 2 :], seg[..., : d // 2]], dim=-1)
        pieces.append((seg * angles.cos() + rotated * angles.sin()).to(x.dtype))
    pieces.append(x[offsets[-1] :])
    return torch.cat(pieces)


def dynamic_max_attention(q: torch.Tensor, params: PackedSeqParams) -> torch.Tensor:
    cu = params.cu_seqlens_q
    max_seqlen = int((cu[1:] - cu[:-1]).max())  # HOST-SYNC-MAX: max_seqlen computed on the device
    return varlen_attention(q, q, q, params.replace(max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen))


class _RopeAttention(nn.Module):
    def __init__(self, rope) -> None:
        super().__init__()
        self.rope = rope
        self.qkv = nn.Linear(H * HD, 3 * H * HD, bias=False)

    def forward(self, x: torch.Tensor, params: PackedSeqParams) -> torch.Tensor:
        q, k, v = self.qkv(x).view(T, 3, H, HD).unbind(1)
        return varlen_attention(self.rope(q, params), self.rope(k, params), v, params).reshape(T, H * HD)


def _line(fn, marker: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if marker in line)


def _inputs():
    torch.manual_seed(0)
    x = torch.randn(T, H * HD, device=DEV, dtype=torch.bfloat16)
    params = PackedSeqParams.from_seqlens([100, 0, 60, 1], capacity=8, total_tokens=T, max_seqlen=T, device=DEV)
    return x, params


def test_find_host_syncs_names_the_unsafe_rope_line(report):
    x, params = _inputs()
    q = x.view(T, H, HD)
    syncs = find_host_syncs(unsafe_rope_thd, q, params)
    line = _line(unsafe_rope_thd, "HOST-SYNC:")
    hits = [s for s in syncs if s.filename == __file__ and s.lineno == line]
    assert hits, f"expected a sync at {__file__}:{line}, found {[str(s) for s in syncs]}"
    report("host syncs: unsafe rope named at", f"{os.path.basename(hits[0].filename)}:{hits[0].lineno} [{hits[0].op}]")
    assert "tolist" in hits[0].code and hits[0].function == "unsafe_rope_thd"
    # every sync found is in this unsafe function: the slicing with host ints and the ops it calls do not sync
    assert all(s.function == "unsafe_rope_thd" for s in syncs), [str(s) for s in syncs]

    syncs = find_host_syncs(dynamic_max_attention, q, params)
    line = _line(dynamic_max_attention, "HOST-SYNC-MAX")
    assert any(s.lineno == line and "_local_scalar_dense" in s.op for s in syncs), [str(s) for s in syncs]


def test_capture_of_unsafe_rope_fails_naming_the_line_and_the_fix():
    x, params = _inputs()
    module = _RopeAttention(unsafe_rope_thd).to(DEV, torch.bfloat16)
    with pytest.raises(GraphCaptureError) as info:
        capture(module, (x.requires_grad_(), params))
    msg = str(info.value)
    assert f"{__file__}:{_line(unsafe_rope_thd, 'HOST-SYNC:')}" in msg
    assert "apply_rope_thd" in msg
    assert info.value.location is not None and info.value.location.function == "unsafe_rope_thd"

    # the failed capture leaves the CUDA RNG usable (its capture epilogue was skipped by the failure)
    ones = torch.ones(4096, device=DEV)
    a, b = torch.nn.functional.dropout(ones, 0.5), torch.nn.functional.dropout(ones, 0.5)
    assert not torch.equal(a, b) and 0.4 < (a > 0).float().mean().item() < 0.6

    # the failed capture leaves CUDA usable: the same module with the graph-safe RoPE captures and matches eager
    safe = _RopeAttention(lambda t, p: apply_rope_thd(t, p)).to(DEV, torch.bfloat16)
    safe.qkv.load_state_dict(module.qkv.state_dict())
    graphed = capture(safe, (x, params))
    other = PackedSeqParams.from_seqlens([7, 200, 3], capacity=8, total_tokens=T, max_seqlen=T, device=DEV)
    with torch.no_grad():
        assert (graphed(x, other).float() - safe(x, other).float()).abs().max().item() <= 1e-2


def test_capture_of_a_device_computed_max_seqlen_suggests_a_static_one():
    x, params = _inputs()
    with pytest.raises(GraphCaptureError, match="pass max_seqlen statically"):
        capture(dynamic_max_attention, (x.view(T, H, HD), params), forward_only=True)


def test_graph_safe_ops_have_no_host_syncs():
    x, params = _inputs()
    module = _RopeAttention(lambda t, p: apply_rope_thd(t, p)).to(DEV, torch.bfloat16)
    x.requires_grad_()

    def step():
        module(x, params).float().square().sum().backward()

    assert find_host_syncs(step) == []
