"""The GPT under torch.compile, on the CPU: where Dynamo breaks its graph (each break splits every layer's kernels)."""

import pytest
import torch

from packgraph.models.gpt import GPT, GPTConfig
from packgraph.packing import PackedBatch


@pytest.mark.parametrize("backend", ["flash", "doc_mask"])
def test_compiled_gpt_breaks_only_at_the_document_mask_build(backend, monkeypatch):
    """torch.compile of the GPT, on a batch whose params carry host offsets and with RoPE's cache empty (a compiled
    model's first call): on the FA2 path one graph; on the document-mask path the graph breaks only where the mask
    is built (document_block_mask says why), as many times for one layer as for three: FlexAttention is traced
    into the model's graph. A break anywhere
    else (a host check, a cache, each attention) splits every layer and keeps its kernels from fusing. On the CPU
    the document mask runs compiled only when told to (``compiled``, as on CUDA)."""
    import packgraph.models.gpt as gpt_mod
    import packgraph.ops.attention as attention_mod
    import packgraph.ops.rope as rope_mod

    build, attend = gpt_mod.document_block_mask, attention_mod.doc_mask_attention
    monkeypatch.setattr(gpt_mod, "document_block_mask", lambda *a, compiled=False: build(*a, compiled=True))
    monkeypatch.setattr(
        attention_mod, "doc_mask_attention", lambda *a, compiled=False, **kw: attend(*a, compiled=True, **kw)
    )
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in (100, 3, 150)]
    batch = PackedBatch.from_documents(docs, bin_size=256, capacity=4)
    assert batch.packed_seq_params.current_host_offsets() is not None
    counts = {}
    for n_layer in (1, 3):
        torch.manual_seed(0)
        cfg = GPTConfig.preset("tiny", d_model=64, n_layer=n_layer, n_head=4, n_kv_head=2, attention_backend=backend)
        rope_mod._inv_freq_cache.clear()
        torch._dynamo.reset()
        with torch.no_grad():
            explained = torch._dynamo.explain(GPT(cfg))(batch)
        elsewhere = [b.reason.splitlines()[0] for b in explained.break_reasons if "_compiled_mask" not in b.reason]
        assert not elsewhere
        counts[n_layer] = (explained.graph_count, explained.graph_break_count)
    # a break per layer would add graphs with the layers (how many one break makes is Dynamo's: a break in nested
    # calls resumes each caller's frame in a graph of its own)
    assert counts[1] == counts[3], counts
    if backend == "flash":
        assert counts[3] == (1, 0)
    else:
        assert counts[3][1] >= 1
