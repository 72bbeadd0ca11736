"""The GPT under torch.compile, on the CPU: where Dynamo breaks its graph (each break splits every layer's kernels)."""

import pytest
import torch

from packgraph.models.gpt import GPT, GPTConfig
from packgraph.packing import PackedBatch


@pytest.mark.parametrize("backend", ["flash", "doc_mask"])
def test_compiled_gpt_breaks_only_at_the_document_masks_compiled_pieces(backend, monkeypatch):
    """torch.compile of the GPT, on a batch whose params carry host offsets and with RoPE's cache empty (a compiled
    model's first call): on the FA2 path one graph; on the document-mask path the graph breaks only where the
    mask's own compiled pieces run (its build, and the attention: doc_mask_attention says why). A break anywhere
    else (a host check, a cache) splits every layer and keeps its kernels from fusing. On the CPU the document mask
    runs those pieces only when told to (``compiled``, as on CUDA)."""
    import packgraph.models.gpt as gpt_mod
    import packgraph.ops.attention as attention_mod
    import packgraph.ops.rope as rope_mod

    build, attend = gpt_mod.document_block_mask, attention_mod.doc_mask_attention
    monkeypatch.setattr(gpt_mod, "document_block_mask", lambda *a, compiled=False: build(*a, compiled=True))
    monkeypatch.setattr(
        attention_mod, "doc_mask_attention", lambda *a, compiled=False, **kw: attend(*a, compiled=True, **kw)
    )
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", d_model=64, n_layer=2, n_head=4, n_kv_head=2, attention_backend=backend))
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in (100, 3, 150)]
    batch = PackedBatch.from_documents(docs, bin_size=256, capacity=4)
    assert batch.packed_seq_params.current_host_offsets() is not None
    rope_mod._inv_freq_cache.clear()
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(batch)
    pieces = ("_compiled_mask", "_compiled_attention")
    elsewhere = [b.reason.splitlines()[0] for b in explained.break_reasons if not any(p in b.reason for p in pieces)]
    assert not elsewhere
    if backend == "flash":
        assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    else:
        assert {p for p in pieces for b in explained.break_reasons if p in b.reason} == set(pieces)
