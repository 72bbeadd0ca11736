"""Experiment: the medium cell's docmask step under variants of doc_mask._attend, with the full kernel list.

python exp/medium_flex.py VARIANT OUT [bench args...]
VARIANT: base | noqk (q, k as strided views, not zeroed) | none (no input zeroing) | noout (no out where)
"""
import sys

import torch

from packgraph.bench import measure, profiling
from packgraph.ops import doc_mask

variant, out, *rest = sys.argv[1:]
_orig = profiling.gpu_busy_ms
measure.gpu_busy_ms = lambda fn, steps=1, top=12: _orig(fn, steps=steps, top=400)


def _attend(q, k, v, live, block_mask, scale, softcap, kernel_options=None):
    from torch.nn.attention.flex_attention import flex_attention

    total = q.shape[0]
    keep = live.view(1, 1, total, 1)

    def z(x):
        return torch.where(keep, x.transpose(0, 1).unsqueeze(0), torch.zeros((), dtype=x.dtype, device=x.device))

    def view(x):
        return x.transpose(0, 1).unsqueeze(0)

    if variant in ("d1", "d1v", "traced_d1"):
        def z3(x):
            y = torch.where(live.view(total, 1, 1), x, torch.zeros((), dtype=x.dtype, device=x.device))
            return y.transpose(0, 1).unsqueeze(0)
        q, k, v = (z3(q), z3(k), z3(v)) if variant != "d1v" else (view(q), view(k), z3(v))
    elif variant == "d5":
        q, k, v = view(q), view(k), view(v)
    elif variant == "noqk":
        q, k, v = view(q), view(k), z(v)
    elif variant == "none":
        q, k, v = view(q), view(k), view(v)
    else:
        q, k, v = z(q), z(k), z(v)
    out = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                         kernel_options=kernel_options)
    out = out[0].transpose(0, 1)
    if variant == "noout":
        return out
    return torch.where(live.view(total, 1, 1), out, torch.zeros((), dtype=out.dtype, device=out.device))


if variant not in ("base", "traced"):
    doc_mask._attend = _attend
if variant in ("traced", "traced_d1"):
    from packgraph.ops import attention as _att

    _orig_dma = _att.doc_mask_attention

    @torch.compiler.assume_constant_result
    def _capability(index):
        return torch.cuda.get_device_capability(index)

    def _tiles(q):
        if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] in (64, 128) and _capability(
            q.device.index
        ) == (9, 0):
            return doc_mask._SM90_FORWARD_TILES | (doc_mask._SM90_D64 if q.shape[-1] == 64 else {})
        return None

    def _dma_traced(q, k, v, params, *, mask=None, compiled=False, causal=True, softmax_scale=None, window=None,
                    softcap=None, **kw):
        if compiled and torch.compiler.is_compiling():
            block_mask, live = mask or doc_mask._compiled_mask(params, q.shape[0], q.device, causal, window)
            fn = _attend if variant == "traced_d1" else doc_mask._attend
            return fn(q, k, v, live, block_mask, softmax_scale, softcap, _tiles(q))
        return _orig_dma(q, k, v, params, mask=mask, compiled=compiled, causal=causal, softmax_scale=softmax_scale,
                         window=window, softcap=softcap, **kw)

    _att.doc_mask_attention = _dma_traced
if variant == "d5":
    from packgraph.ops import attention as _att

    _orig_dma = _att.doc_mask_attention

    def _dma(q, k, v, params, *, mask=None, compiled=False, **kw):
        if compiled and mask is not None:
            live = mask[1].view(-1, 1, 1)
            q, k, v = (torch.where(live, x, torch.zeros((), dtype=x.dtype, device=x.device)) for x in (q, k, v))
        return _orig_dma(q, k, v, params, mask=mask, compiled=compiled, **kw)

    _att.doc_mask_attention = _dma
from packgraph.cli import main  # noqa: E402

sys.exit(main(["bench", "--out", out, *rest]))
