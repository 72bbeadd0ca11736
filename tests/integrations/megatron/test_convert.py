"""Megatron-Core conversion (against the real class when installed) and Megatron RL's fixed-size bin params.

Bin-param references are hand-worked layouts (the cases Megatron-LM's own unit tests pin down for
``create_packed_seq_params_for_bin``) and, when ``megatron.rl`` is importable, the real function.
"""

import dataclasses
import random
from itertools import pairwise
from typing import Any

import pytest
import torch

from packgraph.integrations.megatron import from_megatron, megatron_rl_bin_params, to_megatron
from packgraph.params import PackedSeqParams, PackedSeqParamsError


def _params(**overrides):
    base = PackedSeqParams.from_seqlens([3, 5, 2], capacity=5, pad_to_multiple=4).attention_view()
    return base.replace(**overrides) if overrides else base


# ---------------------------------------------------------------------------------------------------- real class
@pytest.fixture(scope="module")
def megatron_cls():
    module = pytest.importorskip("megatron.core.packed_seq_params")
    return module.PackedSeqParams


@pytest.mark.parametrize("with_cp", [False, True])
def test_round_trip_with_real_megatron_class(megatron_cls, with_cp):
    group = object()  # stands in for a process group: carried by identity
    params = _params(local_cp_size=2, cp_group=group) if with_cp else _params()
    theirs = to_megatron(params)
    assert type(theirs) is megatron_cls
    for f in dataclasses.fields(megatron_cls):
        value = getattr(theirs, f.name)
        if f.name == "pad_between_seqs":  # newer Megatron: set exactly when padded offsets are present
            assert value is True
        elif hasattr(params, f.name):
            assert value is getattr(params, f.name), f.name  # tensors and the group are shared, not copied
        else:
            assert value == f.default, f.name
    back = from_megatron(theirs)
    assert back.equals(params)
    assert back.cp_group is params.cp_group
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert getattr(back, name) is getattr(params, name)


def test_to_megatron_mamba_fields(megatron_cls):
    full = PackedSeqParams.from_seqlens([3, 5], capacity=4).with_seq_idx()
    names = {f.name for f in dataclasses.fields(megatron_cls)}
    for field in ("total_tokens", "seq_idx"):
        if field in names:
            assert getattr(to_megatron(full), field) is getattr(full, field)
        else:
            with pytest.raises(PackedSeqParamsError, match="attention_view"):
                to_megatron(full)
    theirs = to_megatron(full.attention_view())
    assert from_megatron(theirs).equals(full.attention_view())


def test_from_megatron_tensor_max_seqlen(megatron_cls):
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    theirs = megatron_cls(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=torch.tensor(5), max_seqlen_kv=5
    )
    ours = from_megatron(theirs)
    assert (ours.max_seqlen_q, ours.max_seqlen_kv) == (5, 5) and type(ours.max_seqlen_q) is int
    with pytest.raises(PackedSeqParamsError, match="below a real sequence length"):
        from_megatron(
            megatron_cls(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4, max_seqlen_kv=4)
        )


# ---------------------------------------------------------------------------------------------------- by-name logic
@dataclasses.dataclass
class _FutureMegatronParams:
    """A Megatron-like class with a field packgraph does not know (conversion is by name, any version)."""

    qkv_format: str = None
    cu_seqlens_q: Any = None
    cu_seqlens_kv: Any = None
    cu_seqlens_q_padded: Any = None
    cu_seqlens_kv_padded: Any = None
    max_seqlen_q: int = None
    max_seqlen_kv: int = None
    pad_between_seqs: bool = False
    new_feature: Any = None


def test_from_megatron_unknown_fields():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    ok = _FutureMegatronParams("thd", cu, cu, max_seqlen_q=5, max_seqlen_kv=5)
    assert from_megatron(ok).cu_seqlens_q is cu
    with pytest.raises(PackedSeqParamsError, match="new_feature"):
        from_megatron(dataclasses.replace(ok, new_feature=torch.zeros(1)))
    with pytest.raises(PackedSeqParamsError, match="pad_between_seqs"):
        from_megatron(dataclasses.replace(ok, pad_between_seqs=True))
    padded = dataclasses.replace(ok, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu, pad_between_seqs=True)
    assert from_megatron(padded).cu_seqlens_q_padded is cu
    with pytest.raises(TypeError):
        from_megatron({"cu_seqlens_q": cu})


# ---------------------------------------------------------------------------------------------------- RL bin params
def test_rl_bin_params_back_to_back():
    params = megatron_rl_bin_params([7, 5], bin_size=16, max_sequences_per_bin=4)
    assert params.cu_seqlens_q.tolist() == [0, 7, 12, 16, 16, 16]
    assert params.cu_seqlens_kv is params.cu_seqlens_q and params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_q_padded is None and params.cu_seqlens_kv_padded is None
    assert (params.max_seqlen_q, params.max_seqlen_kv, params.total_tokens) == (16, 16, 16)
    assert params.capacity == 5


def test_rl_bin_params_aligned_for_cp():
    params = megatron_rl_bin_params([7, 5], bin_size=24, max_sequences_per_bin=4, seq_length_multiple=4)
    assert params.cu_seqlens_q_padded.tolist() == [0, 8, 16, 24, 24, 24]
    assert params.cu_seqlens_q.tolist() == [0, 7, 12, 20, 20, 20]  # the trailing pad block keeps its full size
    aligned = megatron_rl_bin_params([8, 4], bin_size=16, max_sequences_per_bin=2, seq_length_multiple=4)
    assert aligned.cu_seqlens_q_padded is None  # already aligned: no padded twins, as Megatron does
    assert aligned.cu_seqlens_q.tolist() == [0, 8, 12, 16]


def test_rl_bin_params_take_whole_lengths_and_name_a_fraction():
    assert megatron_rl_bin_params(torch.tensor([7, 5]), bin_size=16, max_sequences_per_bin=4).capacity == 5
    assert megatron_rl_bin_params([7.0, 5], bin_size=16, max_sequences_per_bin=4).cu_seqlens_q.tolist()[:3] == [
        0,
        7,
        12,
    ]
    with pytest.raises(PackedSeqParamsError, match=r"seq_lengths: must be whole numbers.*is 5.5"):
        megatron_rl_bin_params([7, 5.5], bin_size=16, max_sequences_per_bin=4)  # was truncated to 5


def test_rl_bin_params_full_and_empty_bins():
    full = megatron_rl_bin_params([10, 6], bin_size=16, max_sequences_per_bin=2)
    assert full.cu_seqlens_q.tolist() == [0, 10, 16, 16]  # zero-length trailing block
    empty = megatron_rl_bin_params([], bin_size=16, max_sequences_per_bin=3)
    assert empty.cu_seqlens_q.tolist() == [0, 16, 16, 16, 16]


@pytest.mark.parametrize("num_sequences", [1, 10, 48, 49, 50])
def test_rl_bin_params_fixed_size(num_sequences):
    max_sequences_per_bin, bin_size = 50, 1024
    seq_len = bin_size // max_sequences_per_bin
    params = megatron_rl_bin_params(
        [seq_len] * num_sequences, bin_size=bin_size, max_sequences_per_bin=max_sequences_per_bin
    )
    cu = params.cu_seqlens_q.tolist()
    assert len(cu) == max_sequences_per_bin + 2 and cu[0] == 0 and cu[-1] == bin_size
    assert cu[: num_sequences + 1] == [i * seq_len for i in range(num_sequences + 1)]
    assert cu[num_sequences + 1 :] == [bin_size] * (max_sequences_per_bin + 1 - num_sequences)


@pytest.mark.parametrize("multiple", [1, 2, 4, 8])
def test_rl_bin_params_invariants_random(multiple):
    rng = random.Random(multiple)
    for _ in range(50):
        lengths = [rng.randint(1, 20) for _ in range(rng.randint(0, 6))]
        footprint = sum(-(-n // multiple) * multiple for n in lengths)
        bin_size = footprint + multiple * rng.randint(0 if footprint else 1, 5)  # the tail may be empty
        params = megatron_rl_bin_params(
            lengths, bin_size=bin_size, max_sequences_per_bin=6, seq_length_multiple=multiple
        )
        real = params.cu_seqlens_q.tolist()
        layout = params.layout_offsets("q").tolist()
        assert len(real) == len(layout) == 8 and layout[-1] == bin_size
        real_lens = [b - a for a, b in pairwise(real)]
        layout_lens = [b - a for a, b in pairwise(layout)]
        assert real_lens[: len(lengths)] == lengths
        assert all(n % multiple == 0 for n in layout_lens)
        assert real_lens[len(lengths)] == layout_lens[len(lengths)] == bin_size - layout[len(lengths)]
        assert all(n == 0 for n in layout_lens[len(lengths) + 1 :])


def test_rl_bin_params_errors():
    with pytest.raises(PackedSeqParamsError, match="max_sequences_per_bin"):
        megatron_rl_bin_params([1, 1, 1], bin_size=16, max_sequences_per_bin=2)
    with pytest.raises(PackedSeqParamsError, match="overflow"):
        megatron_rl_bin_params([7, 5, 9], bin_size=24, max_sequences_per_bin=4, seq_length_multiple=8)
    with pytest.raises(PackedSeqParamsError, match="divisible"):
        megatron_rl_bin_params([3], bin_size=10, max_sequences_per_bin=4, seq_length_multiple=4)


def test_rl_bin_params_match_megatron_rl():
    """Against Megatron RL's own function (needs a Megatron-LM checkout with megatron.rl importable)."""
    spu = pytest.importorskip("megatron.rl.sequence_packing_utils")
    lengths = [7, 5, 3]
    info = spu.PackingInfo(
        bin_seq_indices=[[0, 1, 2]],
        seq_starts={0: [0, 7, 12, 15]},
        seq_lengths=lengths,
        seq_to_bin_idx=[0, 0, 0],
        packing_algo="fifo",
    )
    theirs = spu.create_packed_seq_params_for_bin(
        packing_info=info, bin_idx=0, bin_size=32, max_sequences_per_bin=8, device=torch.device("cpu")
    )
    ours = megatron_rl_bin_params(lengths, bin_size=32, max_sequences_per_bin=8)
    assert torch.equal(theirs.cu_seqlens_q, ours.cu_seqlens_q)
    assert torch.equal(theirs.cu_seqlens_kv, ours.cu_seqlens_kv)
    assert (theirs.max_seqlen_q, theirs.max_seqlen_kv) == (ours.max_seqlen_q, ours.max_seqlen_kv)


# ---------------------------------------------------------------------------------------------------- host offsets
def test_host_offsets_survive_a_round_trip_through_megatrons_class(megatron_cls):
    params = PackedSeqParams.from_seqlens([3, 5, 2], capacity=5, pad_to_multiple=4).attention_view()
    theirs = to_megatron(params)
    back = from_megatron(theirs)
    assert back.current_host_offsets() == params.current_host_offsets()
    assert back.cu_seqlens_q is params.cu_seqlens_q

    theirs.cu_seqlens_q = params.cu_seqlens_q.clone()  # another tensor: the host copies no longer describe it
    theirs.cu_seqlens_kv = theirs.cu_seqlens_q
    assert from_megatron(theirs).host_offsets is None

    written = to_megatron(params)
    assert from_megatron(written).current_host_offsets() is not None
    written.cu_seqlens_q.add_(0)  # written in place: the version moves, the copies are stale
    assert from_megatron(written).current_host_offsets() is None


def test_the_short_docs_switch_survives_a_round_trip_through_megatrons_class(megatron_cls):
    """Not a Megatron field: carried on Megatron's object, so that a graph boundary that hands a Megatron layer its
    own class keeps the kernel choice the params' signature records."""
    from packgraph import slot_boundary

    params = PackedSeqParams.from_seqlens([3, 5, 2], capacity=5).attention_view()
    for m in (None, 1, 513, slot_boundary.DEFAULT_MIN_SLOTS):
        theirs = to_megatron(params.replace(short_docs_min_slots=m))
        assert isinstance(theirs, megatron_cls)
        assert from_megatron(theirs).short_docs_min_slots == m
    assert from_megatron(megatron_cls(qkv_format="thd", cu_seqlens_q=params.cu_seqlens_q,
                                      cu_seqlens_kv=params.cu_seqlens_kv, max_seqlen_q=5, max_seqlen_kv=5)
                         ).short_docs_min_slots == slot_boundary.DEFAULT_MIN_SLOTS  # fmt: skip


def test_megatron_params_are_registered_with_the_engine(megatron_cls):
    from packgraph.params import params_type_of

    params = _params()
    found = params_type_of(to_megatron(params))
    assert found is not None
    ours = found.to_packgraph(to_megatron(params))
    assert isinstance(ours, PackedSeqParams) and ours.equals(params)
    assert type(found.from_packgraph(params)) is megatron_cls


def test_to_megatron_gives_mamba_layers_megatrons_seq_idx_without_a_sync(megatron_cls):
    names = {f.name for f in dataclasses.fields(megatron_cls)}
    params = PackedSeqParams.from_seqlens([5, 0, 6], capacity=5, total_tokens=20, pad_to_multiple=4)
    if "seq_idx" not in names:  # Megatron-Core 0.16: no Mamba fields on the class
        with pytest.raises(PackedSeqParamsError, match="attention_view"):
            to_megatron(params)
        return
    theirs = to_megatron(params)
    assert theirs.cu_seqlens_q is params.cu_seqlens_q and theirs.total_tokens == 20
    # Megatron's own constructor computes seq_idx from cu_seqlens and total_tokens: the reference
    reference = megatron_cls(
        qkv_format="thd",
        cu_seqlens_q=params.cu_seqlens_q,
        cu_seqlens_kv=params.cu_seqlens_kv,
        cu_seqlens_q_padded=params.cu_seqlens_q_padded,
        cu_seqlens_kv_padded=params.cu_seqlens_kv_padded,
        max_seqlen_q=params.max_seqlen_q,
        max_seqlen_kv=params.max_seqlen_kv,
        total_tokens=20,
    )
    assert torch.equal(theirs.seq_idx, reference.seq_idx)
    given = params.with_seq_idx()
    assert to_megatron(given).seq_idx is given.seq_idx  # a seq_idx the params carry is kept, not rebuilt


def test_capture_takes_megatron_params_and_hands_the_callable_megatrons_class(megatron_cls):
    """The engine splits a Megatron PackedSeqParams like packgraph's (its registration here): cu_seqlens are graph
    inputs, so new offsets replay the same graph; the captured function receives Megatron's class."""
    from packgraph.graphs import capture, use_recorder
    from packgraph.ops import varlen_attention
    from tests.eager_recorder import EagerRecorder

    seen = []

    def attend(x, packed_seq_params):
        seen.append(type(packed_seq_params))
        return varlen_attention(x, x, x, from_megatron(packed_seq_params, validate=False))

    def params(lengths):
        return to_megatron(PackedSeqParams.from_seqlens(lengths, capacity=4, max_seqlen=12).attention_view())

    x = torch.randn(12, 2, 8)
    with use_recorder(EagerRecorder()):
        graphed = capture(attend, (x, params([5, 7])), forward_only=True)
    for lengths in ([5, 7], [12], [1, 2, 3, 6]):
        seen.clear()
        out = graphed(x, params(lengths))
        assert seen == [megatron_cls]  # the replayed body got Megatron's class, rebuilt on the static buffers
        assert torch.equal(out, attend(x, params(lengths)))
    assert graphed.num_graphs == 1  # one signature: only the offsets changed
