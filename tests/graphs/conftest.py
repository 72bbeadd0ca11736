import pytest
import torch

import packgraph.graphs.entry as entry_module
import packgraph.graphs.memory as handouts_module


@pytest.fixture
def handout_path(request, monkeypatch):
    """How held handed-out memory is kept through later replays (``packgraph.graphs.memory``): ``"copy"`` (the
    default settings: small outputs go out as copies), ``"swap"`` (every output on a handle, settled by
    ``_swap_data_ptr_``), ``"scan"`` (every output on a handle, settled by moving holders one by one, as on a torch
    without ``_swap_data_ptr_``)."""
    path = request.param
    if path == "swap" and not hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        pytest.skip(f"torch {torch.__version__} has no UntypedStorage._swap_data_ptr_")
    if path in ("swap", "scan"):
        monkeypatch.setattr(entry_module, "COPIED_OUTPUT_BYTES", 0)
        monkeypatch.setattr(handouts_module, "SWAP_DATA_PTR", path == "swap")
    return path
