import importlib

import pytest

from packgraph import slot_boundary


@pytest.fixture
def reload_after(monkeypatch):
    yield
    monkeypatch.delenv(slot_boundary.ENV, raising=False)
    importlib.reload(slot_boundary)


def test_environment_sets_the_switch_at_import(monkeypatch, reload_after):
    monkeypatch.setenv(slot_boundary.ENV, " 513 ")
    assert importlib.reload(slot_boundary).SHORT_DOCS_MIN_SLOTS == 513
    monkeypatch.setenv(slot_boundary.ENV, "")
    assert importlib.reload(slot_boundary).SHORT_DOCS_MIN_SLOTS == slot_boundary.DEFAULT == 129
    for off in ("off", " None "):
        monkeypatch.setenv(slot_boundary.ENV, off)
        assert importlib.reload(slot_boundary).SHORT_DOCS_MIN_SLOTS is None
    for bad in ("many", "0", "-4", "5.5"):
        monkeypatch.setenv(slot_boundary.ENV, bad)
        with pytest.raises(ValueError, match="PACKGRAPH_SHORT_DOCS_MIN_SLOTS must be a number of slots"):
            importlib.reload(slot_boundary)


def test_bucket_slots_keeps_the_kernel_of_the_params(monkeypatch):
    monkeypatch.setattr(slot_boundary, "SHORT_DOCS_MIN_SLOTS", None)
    assert slot_boundary.bucket_slots(2048, 10) == 10  # off: ghosts may all go
    monkeypatch.setattr(slot_boundary, "SHORT_DOCS_MIN_SLOTS", 513)
    assert slot_boundary.bucket_slots(2048, 10) == 513  # short_docs at 2048 slots: the bucket keeps >= 513
    assert slot_boundary.bucket_slots(2048, 900) == 900
    assert slot_boundary.bucket_slots(512, 10) == 10  # FlashAttention at 512: any bucket below 513 keeps it


def test_with_boundary_rung_adds_the_rung_below_the_switch(monkeypatch):
    monkeypatch.setattr(slot_boundary, "SHORT_DOCS_MIN_SLOTS", 129)
    assert slot_boundary.with_boundary_rung((8, 64, 256)) == (8, 64, 128, 256)
    assert slot_boundary.with_boundary_rung((8, 128, 512)) == (8, 128, 512)  # has it
    assert slot_boundary.with_boundary_rung((8, 64, 128)) == (8, 64, 128)  # nothing reaches 129
    assert slot_boundary.with_boundary_rung((129,)) == (128, 129)
    monkeypatch.setattr(slot_boundary, "SHORT_DOCS_MIN_SLOTS", None)
    assert slot_boundary.with_boundary_rung((8, 64, 256)) == (8, 64, 256)
