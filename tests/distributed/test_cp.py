"""Context parallelism on CPU with gloo: sharding index math, and CP attention vs unsharded references.

The multi-process tests spawn CP ranks (2 and 4) that each rebuild the same global stream, shard it, run
``cp_varlen_attention`` forward and backward, and compare their rows with a float64 per-document loop on the
whole stream (and with ``varlen_attention_reference``).
"""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from packgraph.distributed import cp_position_ids, cp_shard_index, cp_varlen_attention, shard_thd_for_cp
from packgraph.ops import varlen_attention_reference
from packgraph.packing import PackedBatch
from packgraph.params import GroupIdentity, PackedSeqParams, PackedSeqParamsError


# ---------------------------------------------------------------------------------------------------- references
def naive_shard_rows(layout: list[int], T: int, cp_rank: int, cp_size: int) -> list[int]:
    """Rank ``cp_rank``'s global rows, by the definition: chunks r and 2CP-1-r of every segment (tail included)."""
    n = 2 * cp_size
    rows = []
    for start, end in zip([*layout], [*layout[1:], T], strict=True):
        c = (end - start) // n
        for chunk in (cp_rank, n - 1 - cp_rank):
            rows.extend(range(start + chunk * c, start + (chunk + 1) * c))
    return rows


def naive_attention(q, k, v, layout: list[int], lengths: list[int], scale: float):
    """Causal attention, one document at a time, float64; rows outside every document stay 0."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    for start, n in zip(layout, lengths, strict=False):
        if n == 0:
            continue
        qs = q[start : start + n]
        ks = k[start : start + n].repeat_interleave(group, dim=1)
        vs = v[start : start + n].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        out[start : start + n] = torch.einsum("hqk,khd->qhd", probs, vs)
    return out


# ---------------------------------------------------------------------------------------------------- one process
@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 23), min_size=1, max_size=6),
    ghosts=st.integers(0, 2),
    tail_chunks=st.integers(0, 2),
    cp_size=st.integers(1, 4),
)
def test_shard_index_partitions_rows_by_the_chunk_rule(lengths, ghosts, tail_chunks, cp_size):
    n = 2 * cp_size
    padded_total = sum(-(-x // n) * n for x in lengths)
    T = padded_total + tail_chunks * n
    params = PackedSeqParams.from_seqlens(lengths, capacity=len(lengths) + ghosts, total_tokens=T, pad_to_multiple=n)
    layout = list(params.layout_offsets("q").tolist())
    real = [0] + list(torch.tensor(lengths).cumsum(0).tolist())
    seen = []
    for r in range(cp_size):
        shard = shard_thd_for_cp(torch.arange(T), params, r, cp_size)
        rows = shard.data.tolist()
        assert rows == naive_shard_rows(layout, T, r, cp_size)
        assert cp_shard_index(params, r, cp_size).tolist() == rows
        local = shard.packed_seq_params
        assert local.local_cp_size == cp_size and local.total_tokens == T // cp_size
        assert local.layout_offsets("q").tolist() == [o // cp_size for o in layout]
        # Each slot's local real rows: a prefix of its local segment, holding exactly its global real rows.
        for i, x in enumerate(lengths):
            seg = rows[layout[i] // cp_size : layout[i + 1] // cp_size]
            want = [g for g in seg if g - layout[i] < x]
            got_len = local.cu_seqlens_q[i + 1] - local.cu_seqlens_q[i]
            assert seg[: int(got_len)] == want
        # Global positions for real rows, 0 on dead rows.
        want_pos = []
        for g in rows:
            slot = next((i for i in range(len(lengths)) if layout[i] <= g < layout[i] + lengths[i]), None)
            want_pos.append(g - layout[slot] if slot is not None else 0)
        assert shard.position_ids.tolist() == want_pos
        assert local.validate() is local
        seen += rows
    assert sorted(seen) == list(range(T))
    assert real[-1] == sum(lengths)


def test_shard_packed_batch_keeps_targets_and_positions():
    docs = [torch.arange(7), torch.arange(100, 103), torch.arange(50, 51)]
    batch = PackedBatch.from_documents(docs, bin_size=32, capacity=4, pad_to_multiple=4)
    seen_tokens, seen_labels = [], []
    for r in range(2):
        local, params, pos = shard_thd_for_cp(batch, None, r, 2)
        assert isinstance(local, PackedBatch) and local.packed_seq_params is params
        index = cp_shard_index(batch.packed_seq_params, r, 2)
        torch.testing.assert_close(local.tokens, batch.tokens[index])
        torch.testing.assert_close(local.labels, batch.labels[index])
        torch.testing.assert_close(local.loss_mask, batch.loss_mask[index])
        assert local.position_ids.tolist() == pos.tolist() == batch.position_ids[index].tolist()
        assert local.doc_lengths is None
        seen_tokens += local.tokens.tolist()
        seen_labels += local.labels.tolist()
    assert sorted(seen_tokens) == sorted(batch.tokens.tolist())
    assert sorted(seen_labels) == sorted(batch.labels.tolist())


def test_shard_rejects_layouts_that_do_not_split_evenly():
    params = PackedSeqParams.from_seqlens([5, 3], total_tokens=16)  # no padding: 5 is not a multiple of 4
    with pytest.raises(PackedSeqParamsError, match="multiple of 2\\*CP=4"):
        shard_thd_for_cp(torch.zeros(16), params, 0, 2)
    params = PackedSeqParams.from_seqlens([5, 3], total_tokens=18, pad_to_multiple=4)
    with pytest.raises(PackedSeqParamsError, match="total_tokens"):
        shard_thd_for_cp(torch.zeros(18), params, 0, 2)
    params = PackedSeqParams.from_seqlens([3, 3], total_tokens=16, pad_to_multiple=8)  # 8 > roundup(3, 4)
    with pytest.raises(PackedSeqParamsError, match="max_seqlen_q"):
        shard_thd_for_cp(torch.zeros(16), params, 0, 2)
    params = PackedSeqParams.from_seqlens([5, 3], total_tokens=16, pad_to_multiple=4)
    with pytest.raises(ValueError, match="cp_rank"):
        shard_thd_for_cp(torch.zeros(16), params, 2, 2)
    local = shard_thd_for_cp(torch.zeros(16), params, 0, 2).packed_seq_params
    with pytest.raises(PackedSeqParamsError, match="already sharded"):
        shard_thd_for_cp(torch.zeros(8), local, 0, 2)


# ---------------------------------------------------------------------------------------------------- multi-process
# (lengths, capacity, extra tail rows in units of 2*CP, Hq, Hkv, D, softmax_scale)
CASES = [
    ([13, 1, 7, 0, 22, 3], 8, 1, 4, 2, 8, None),  # padding, a 1-token doc, an empty doc, ghosts, GQA, a tail
    ([2, 3, 1], 3, 0, 2, 2, 4, 0.3),  # every doc shorter than 2*CP (for CP=2 some, for CP=4 all)
    ([16], 1, 2, 2, 1, 6, None),  # one long doc, no padding needed for CP=2/4
]


def _cp_worker(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        n = 2 * world
        for case_id, (lengths, capacity, tail, hq, hkv, d, scale) in enumerate(CASES):
            padded_total = sum(-(-x // n) * n for x in lengths)
            T = padded_total + tail * n
            params = PackedSeqParams.from_seqlens(lengths, capacity=capacity, total_tokens=T, pad_to_multiple=n)
            gen = torch.Generator().manual_seed(case_id)
            q, k, v = (torch.randn(T, h, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
            dout = torch.randn(T, hq, d, generator=gen, dtype=torch.float64)

            # Unsharded references on every rank (cheap): a per-document loop, and the package's reference op.
            ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
            layout = params.layout_offsets("q").tolist()
            ref = naive_attention(*ref_in, layout, lengths, scale if scale is not None else 1 / math.sqrt(d))
            (ref * dout).sum().backward()
            ref_grads = [t.grad for t in ref_in]
            op_ref = varlen_attention_reference(q, k, v, params, softmax_scale=scale)
            torch.testing.assert_close(op_ref, ref.detach(), rtol=0, atol=1e-12)

            (q_l, k_l, v_l, dout_l), local, pos = shard_thd_for_cp((q, k, v, dout), params, rank, world)
            assert local.cp_group is group and local.local_cp_size == world
            sig = local.static_signature()
            assert sig.local_cp_size == world and sig.cp_group == GroupIdentity(group)
            index = cp_shard_index(params, rank, world)
            q_l, k_l, v_l = (t.clone().requires_grad_() for t in (q_l, k_l, v_l))
            out = cp_varlen_attention(q_l, k_l, v_l, local, softmax_scale=scale)
            (out * dout_l).sum().backward()

            where = f"case {case_id}, rank {rank}/{world}"
            torch.testing.assert_close(out, ref.detach()[index], rtol=0, atol=1e-12, msg=lambda m, w=where: f"{w}: {m}")
            for name, got, want in zip("qkv", (q_l.grad, k_l.grad, v_l.grad), ref_grads, strict=True):
                torch.testing.assert_close(
                    got, want[index], rtol=0, atol=1e-12, msg=lambda m, w=where, n=name: f"{w} d{n}: {m}"
                )
            # Dead rows (padding, tail): exact zeros in the output and in every gradient.
            dead = ~_live_rows(layout, lengths, T)[index]
            assert dead.any(), where
            for t in (out, q_l.grad, k_l.grad, v_l.grad):
                assert t[dead].eq(0).all(), where
            assert torch.equal(cp_position_ids(local), pos), where
            # The shards partition the stream.
            everyone = [torch.empty_like(index) for _ in range(world)]
            dist.all_gather(everyone, index)
            assert torch.equal(torch.cat(everyone).sort().values, torch.arange(T)), where
        _gpt_worker_case(rank, world)
    finally:
        dist.destroy_process_group()


def _cp_gpt(cfg):
    """The reference GPT with context-parallel attention halves (RoPE on global positions), same weights."""
    from packgraph.models.gpt import GPT, AttentionBlock
    from packgraph.ops import apply_rope_thd

    class CPAttention(AttentionBlock):
        def forward(self, x, packed_seq_params):
            T, hd = x.shape[0], self.head_dim
            q, k, v = self.qkv(self.norm(x)).split([self.n_head * hd, self.n_kv_head * hd, self.n_kv_head * hd], -1)
            pos = cp_position_ids(packed_seq_params, T)
            q = apply_rope_thd(q.view(T, -1, hd), packed_seq_params, base=self.rope_base, position_ids=pos)
            k = apply_rope_thd(k.view(T, -1, hd), packed_seq_params, base=self.rope_base, position_ids=pos)
            y = cp_varlen_attention(q, k, v.view(T, -1, hd), packed_seq_params)
            return x + self.proj(y.reshape(T, -1))

    torch.manual_seed(0)
    model = GPT(cfg).double()
    for block in model.blocks:
        attn = CPAttention(cfg).double()
        attn.load_state_dict(block.attn.state_dict())
        block.attn = attn
    return model


def _gpt_worker_case(rank: int, world: int) -> None:
    """A tiny GPT trained one step under CP equals the unsharded GPT: loss and every parameter gradient."""
    from packgraph.distributed import allreduce_gradients, global_token_count
    from packgraph.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=32, n_layer=2, n_head=4, n_kv_head=2, d_model=32)
    gen = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 32, (n,), generator=gen) for n in (13, 1, 7, 22, 2)]
    batch = PackedBatch.from_documents(docs, bin_size=64, capacity=6, pad_to_multiple=2 * world, pad_id=0)

    torch.manual_seed(0)
    reference = GPT(cfg).double()
    logits = reference(batch.tokens, batch.packed_seq_params)
    ref_loss = F.cross_entropy(logits.float(), batch.labels, ignore_index=-100)
    ref_loss.backward()

    model = _cp_gpt(cfg)
    local, params, _ = shard_thd_for_cp(batch, None, rank, world)
    count = global_token_count(local.loss_mask.sum())
    assert count.item() == batch.num_real_tokens
    logits = model(local.tokens, params)
    loss = F.cross_entropy(logits.float(), local.labels, ignore_index=-100, reduction="sum") / count
    loss.backward()
    allreduce_gradients(model)
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref_loss.detach(), rtol=1e-6, atol=0)
    want = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def _live_rows(layout: list[int], lengths: list[int], T: int) -> torch.Tensor:
    live = torch.zeros(T, dtype=torch.bool)
    for start, n in zip(layout, lengths, strict=False):
        live[start : start + n] = True
    return live


def _start(fn, world: int) -> None:
    # fork skips re-importing torch in every child (seconds each on a busy 2-core box); the workers use CPU only.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(fn, args=(world, os.path.join(tmp, "init")), nprocs=world, start_method=method)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_cp_attention_matches_unsharded_reference(cp_size):
    _start(_cp_worker, cp_size)
