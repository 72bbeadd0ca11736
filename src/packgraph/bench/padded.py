"""The padded baseline: documents right-padded to ``[B, L]`` and the GPT's loss on that layout.

``padded`` needs no mask for exactness: with right padding, a causal query row of a real token only sees keys at
or before it, which are all real. The padding enters through the loss mask (pad rows have label -100), so the
padded loss equals the packed one. ``padded-mask`` is the literal recipe (a boolean mask forces SDPA off its
flash kernel) for those who want that baseline too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from packgraph.bench.data import doc_tokens
from packgraph.data.corpus import PAD_ID
from packgraph.models.gpt import GPT, masked_mean_ce
from packgraph.ops import apply_rope_thd
from packgraph.packing import IGNORE_INDEX, PackedBatch

__all__ = ["PaddedBatch", "padded_batch", "padded_loss"]


@dataclass
class PaddedBatch:
    """Documents right-padded to the batch max: ``tokens``, ``labels``, ``loss_mask`` are ``[B, L]``.

    ``lengths`` (int64 ``[B]``) are the real lengths; pad rows hold ``PAD_ID``, label -100 and mask 0.
    """

    tokens: Tensor
    labels: Tensor
    loss_mask: Tensor
    lengths: Tensor

    def to(self, device: torch.device | str) -> PaddedBatch:
        return PaddedBatch(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


def padded_batch(batch: PackedBatch) -> PaddedBatch:
    """The documents of a host-side packed batch as a padded ``[B, L]`` batch with the same labels and mask."""
    offsets = batch.packed_seq_params.host_offsets["cu_seqlens_q"]
    docs = doc_tokens(batch)
    B, L = max(len(docs), 1), max((len(d) for d in docs), default=1)
    tokens = torch.full((B, L), PAD_ID, dtype=torch.int64)
    labels = torch.full((B, L), IGNORE_INDEX, dtype=torch.int64)
    loss_mask = torch.zeros(B, L, dtype=torch.float32)
    for i, d in enumerate(docs):
        a, n = offsets[i], len(d)
        tokens[i, :n] = d
        labels[i, :n] = batch.labels[a : a + n]
        loss_mask[i, :n] = batch.loss_mask[a : a + n]
    lengths = torch.tensor([len(d) for d in docs] or [0], dtype=torch.int64)
    return PaddedBatch(tokens, labels, loss_mask, lengths)


def padded_loss(model: GPT, batch: PaddedBatch, *, padding_mask: bool = False) -> Tensor:
    """The GPT's masked-mean loss on a padded ``[B, L]`` batch, with the model's own modules and weights.

    Mirrors ``AttentionBlock.forward`` with ``[B, L]`` rows: RoPE positions ``0..L-1`` per row
    (``apply_rope_thd`` with ``position_ids``) and SDPA instead of varlen attention. Causal SDPA is exact on real
    rows (see the module docstring); ``padding_mask=True`` passes an explicit ``causal & key_valid`` mask.
    """
    B, L = batch.tokens.shape
    device = batch.tokens.device
    x = model.embed_tokens(batch.tokens)
    positions = torch.arange(L, device=device).repeat(B)
    attn_mask = None
    if padding_mask:
        key_valid = torch.arange(L, device=device)[None, :] < batch.lengths[:, None]
        causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
        attn_mask = causal[None, None] & key_valid[:, None, None, :]
    for block in model.blocks:
        a = block.attn
        H, Hkv, D = a.n_head, a.n_kv_head, a.head_dim
        q, k, v = a.qkv(a.norm(x)).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = apply_rope_thd(q.reshape(B * L, H, D), None, base=a.rope_base, position_ids=positions)
        k = apply_rope_thd(k.reshape(B * L, Hkv, D), None, base=a.rope_base, position_ids=positions)
        q, k, v = (t.reshape(B, L, -1, D).transpose(1, 2) for t in (q, k, v))
        if Hkv != H:
            k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None)
        x = x + a.dropout(a.proj(y.transpose(1, 2).reshape(B, L, H * D)))
        x = block.mlp(x)
    logits = model.logits_from_hidden(x)
    return masked_mean_ce(logits.reshape(B * L, -1), batch.labels.reshape(-1), batch.loss_mask.reshape(-1))
