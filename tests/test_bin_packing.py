"""pack_sequences, checked against naive scan-based packers."""

from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packgraph.bin_packing import pack_sequences

SETTINGS = settings(max_examples=80, deadline=None)


def footprint(n, m):
    return -(-n // m) * m


# ---------------------------------------------------------------------------------------------- naive packers
def naive_pack(lengths, bin_size, max_seqs, multiple, algorithm):
    """Straight scans over every bin, as the textbook states each algorithm."""
    limit = (bin_size // multiple) * multiple
    eff = [min(n, limit) for n in lengths]
    foot = [footprint(n, multiple) for n in eff]
    order = sorted(range(len(eff)), key=lambda i: (-foot[i], i))
    bins, loads = [], []

    def fits(b, i):
        return loads[b] + foot[i] <= bin_size and len(bins[b]) < max_seqs

    for i in order:
        if algorithm == "ffd":
            target = next((b for b in range(len(bins)) if fits(b, i)), None)
        elif algorithm == "bfd":
            candidates = [(bin_size - loads[b], b) for b in range(len(bins)) if fits(b, i)]
            target = min(candidates)[1] if candidates else None
        else:
            target = len(bins) - 1 if bins and fits(len(bins) - 1, i) else None
        if target is None:
            bins.append([])
            loads.append(0)
            target = len(bins) - 1
        bins[target].append(i)
        loads[target] += foot[i]
    return [sorted(b) for b in bins], eff


packing_cases = st.fixed_dictionaries(
    {
        "lengths": st.lists(st.integers(0, 300), max_size=60),
        "bin_size": st.integers(1, 400),
        "multiple": st.integers(1, 8),
        "max_seqs": st.integers(1, 12),
        "algorithm": st.sampled_from(["ffd", "bfd", "nfd"]),
    }
).filter(lambda c: c["bin_size"] >= c["multiple"])


def unpack(case):
    return tuple(case[k] for k in ("lengths", "bin_size", "multiple", "max_seqs", "algorithm"))


def check_invariants(packing, lengths, bin_size, max_seqs, multiple):
    placed = sorted(i for b in packing for i in b)
    assert placed == list(range(len(lengths))), "a document was lost or duplicated"
    limit = (bin_size // multiple) * multiple
    assert list(packing.lengths) == [min(n, limit) for n in lengths]
    assert list(packing.truncated) == [i for i, n in enumerate(lengths) if n > limit]
    for b in packing:
        assert 1 <= len(b) <= max_seqs
        assert b == sorted(b)
        assert sum(footprint(packing.lengths[i], multiple) for i in b) <= bin_size
    expected = Fraction(sum(packing.lengths), len(packing) * bin_size) if len(packing) else Fraction(0)
    assert packing.efficiency == pytest.approx(float(expected), rel=1e-12, abs=0)


@SETTINGS
@given(packing_cases)
def test_pack_matches_naive_reference(case):
    lengths, bin_size, m, max_seqs, alg = unpack(case)
    packing = pack_sequences(
        lengths, bin_size, max_seqs_per_bin=max_seqs, multiple=m, algorithm=alg, overlong="truncate"
    )
    check_invariants(packing, lengths, bin_size, max_seqs, m)
    want_bins, _ = naive_pack(lengths, bin_size, max_seqs, m, alg)
    assert list(packing) == want_bins
    assert packing.algorithm == alg and packing.bin_size == bin_size
    again = pack_sequences(lengths, bin_size, max_seqs_per_bin=max_seqs, multiple=m, algorithm=alg, overlong="truncate")
    assert list(again) == list(packing)


@SETTINGS
@given(packing_cases)
def test_overlong_raise_names_every_index(case):
    lengths, bin_size, m, max_seqs, alg = unpack(case)
    limit = (bin_size // m) * m
    over = [i for i, n in enumerate(lengths) if n > limit]
    if not over:
        packing = pack_sequences(lengths, bin_size, max_seqs_per_bin=max_seqs, multiple=m, algorithm=alg)
        check_invariants(packing, lengths, bin_size, max_seqs, m)
        assert packing.truncated == ()
        return
    with pytest.raises(ValueError) as err:
        pack_sequences(lengths, bin_size, max_seqs_per_bin=max_seqs, multiple=m, algorithm=alg)
    for i in over[:20]:
        assert f"{i} (len {lengths[i]})" in str(err.value)


def test_truncate_keeps_largest_fitting_length():
    packing = pack_sequences([10, 13, 16, 17, 0], 16, max_seqs_per_bin=4, multiple=8, overlong="truncate")
    # 17 pads to 24 > 16, so it is cut to 16 (pads to 16); 13 pads to 16 and fits untouched.
    assert packing.lengths == (10, 13, 16, 16, 0)
    assert packing.truncated == (3,)
    check_invariants(packing, [10, 13, 16, 17, 0], 16, 4, 8)


def test_zero_length_documents_take_a_slot():
    packing = pack_sequences([0, 0, 0, 0, 0], 8, max_seqs_per_bin=2)
    assert sorted(len(b) for b in packing) == [1, 2, 2]
    assert packing.efficiency == 0.0
    empty = pack_sequences([], 8, max_seqs_per_bin=2)
    assert list(empty) == [] and empty.efficiency == 0.0


@pytest.mark.parametrize("algorithm", ["ffd", "bfd", "nfd"])
def test_pack_5000_documents(algorithm):
    gen = torch.Generator().manual_seed(1)
    lengths = (torch.rand(5000, generator=gen) ** 4 * 6000).long().tolist()  # heavy tail, some overlong
    packing = pack_sequences(lengths, 4096, max_seqs_per_bin=64, multiple=8, algorithm=algorithm, overlong="truncate")
    check_invariants(packing, lengths, 4096, 64, 8)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"algorithm": "worst"}, "algorithm"),
        ({"overlong": "drop"}, "overlong"),
        ({"max_seqs_per_bin": 0}, "max_seqs_per_bin"),
        ({"multiple": 32}, "bin_size"),
    ],
)
def test_pack_rejects_bad_arguments(kwargs, match):
    args = {"max_seqs_per_bin": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        pack_sequences([3, 4], 16, **args)
    with pytest.raises(ValueError, match="negative"):
        pack_sequences([3, -1], 16, max_seqs_per_bin=4)


@pytest.mark.parametrize(
    "lengths, shown",
    [
        ([2.5, 3.9], "lengths[0] is 2.5"),
        (torch.tensor([2.0, 3.9]), "lengths[1] is 3.9"),
        (torch.tensor([[2, 3]]), "must be 1-D"),
        ([[2, 3]], "lengths[0] is [2, 3]"),
    ],
)
def test_pack_rejects_lengths_that_are_not_whole_numbers(lengths, shown):
    # Issue #31 item 7: int() would have truncated 2.5 and 3.9 to 2 and 3 and packed documents of the wrong size.
    with pytest.raises(ValueError) as e:
        pack_sequences(lengths, 8, max_seqs_per_bin=4)
    message = str(e.value)
    assert message.startswith("pack_sequences: lengths ") and shown in message and "\n" not in message
    assert pack_sequences([2.0, 3.0], 8, max_seqs_per_bin=4).lengths == (2, 3)  # whole floats are whole numbers
