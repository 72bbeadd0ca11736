import importlib

import pytest

from packgraph import slot_boundary


@pytest.fixture
def reload_after(monkeypatch):
    yield
    monkeypatch.delenv(slot_boundary.ENV, raising=False)
    importlib.reload(slot_boundary)


def test_environment_sets_the_default_at_import(monkeypatch, reload_after):
    monkeypatch.setenv(slot_boundary.ENV, " 513 ")
    assert importlib.reload(slot_boundary).DEFAULT_MIN_SLOTS == 513
    monkeypatch.setenv(slot_boundary.ENV, "")
    assert importlib.reload(slot_boundary).DEFAULT_MIN_SLOTS == slot_boundary.DEFAULT == 129
    for off in ("off", " None "):
        monkeypatch.setenv(slot_boundary.ENV, off)
        assert importlib.reload(slot_boundary).DEFAULT_MIN_SLOTS is None
    for bad in ("many", "0", "-4", "5.5"):
        monkeypatch.setenv(slot_boundary.ENV, bad)
        with pytest.raises(ValueError, match="PACKGRAPH_SHORT_DOCS_MIN_SLOTS must be a number of slots"):
            importlib.reload(slot_boundary)


def test_bucket_slots_keeps_the_kernel_of_the_params():
    assert slot_boundary.bucket_slots(2048, 10, None) == 10  # off: ghosts may all go
    assert slot_boundary.bucket_slots(2048, 10, 513) == 513  # short_docs at 2048 slots: the bucket keeps >= 513
    assert slot_boundary.bucket_slots(2048, 900, 513) == 900
    assert slot_boundary.bucket_slots(512, 10, 513) == 10  # FlashAttention at 512: any bucket below 513 keeps it


def test_with_boundary_rung_adds_the_rung_below_the_switch():
    assert slot_boundary.with_boundary_rung((8, 64, 256), 129) == (8, 64, 128, 256)
    assert slot_boundary.with_boundary_rung((8, 128, 512), 129) == (8, 128, 512)  # has it
    assert slot_boundary.with_boundary_rung((8, 64, 128), 129) == (8, 64, 128)  # nothing reaches 129
    assert slot_boundary.with_boundary_rung((129,), 129) == (128, 129)
    assert slot_boundary.with_boundary_rung((8, 64, 256), None) == (8, 64, 256)


def test_the_switch_is_data_of_the_params_and_of_the_policy():
    """``short_docs_min_slots``: checked, in the params' static signature (a graph captured under one value is not
    another's), and stamped by the policy that buckets them (tests/integrations/megatron/test_convert.py: kept
    across Megatron's params class)."""
    from packgraph import BucketPolicy, PackedSeqParams, PackedSeqParamsError

    params = PackedSeqParams.from_seqlens([5, 3, 7], capacity=4, total_tokens=16)
    assert params.short_docs_min_slots == slot_boundary.DEFAULT_MIN_SLOTS
    for bad in (0, -3, 2.0, True, "129"):
        with pytest.raises(PackedSeqParamsError, match="short_docs_min_slots"):
            params.replace(short_docs_min_slots=bad).validate()
    with pytest.raises(ValueError, match="BucketPolicy.short_docs_min_slots must be a number of slots"):
        BucketPolicy((16,), (8,), short_docs_min_slots=0)
    other = params.replace(short_docs_min_slots=None)
    diff = other.static_signature().diff(params.static_signature())
    assert diff == [("short_docs_min_slots", None, slot_boundary.DEFAULT_MIN_SLOTS)]
    rebuilt = PackedSeqParams.from_graph_inputs(other.graph_inputs(), other.static_signature())
    assert rebuilt.short_docs_min_slots is None
    policy = BucketPolicy((16,), (8, 64, 1024), short_docs_min_slots=513)
    assert policy.capacity_ladder == (8, 64, 512, 1024)  # its own switch's rung
    assert policy.apply(params).short_docs_min_slots == 513
    assert BucketPolicy((16,), (8,), short_docs_min_slots=None).apply(params).short_docs_min_slots is None
