"""GPU tests: every test here is marked `cuda`; figures go to the gpu-check report."""

import json
import os

import pytest
import torch


@pytest.fixture
def report(request):
    """`report(name, value, unit="")` records a figure for scripts/gpu-check's closing table.

    Figures are appended as JSON lines to $PACKGRAPH_REPORT when set (gpu-check sets it), and always printed.
    """
    path = os.environ.get("PACKGRAPH_REPORT")

    def _report(name: str, value, unit: str = "") -> None:
        row = {"test": request.node.nodeid, "name": name, "value": value, "unit": unit}
        print(f"[report] {name}: {value} {unit}")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    return _report


@pytest.fixture(autouse=True)
def _cuda_seed():
    if torch.cuda.is_available():
        torch.manual_seed(0)
        torch.cuda.manual_seed(0)


@pytest.fixture(autouse=True)
def _loop_stream(request):
    """Each test runs on a loop stream of its own, as packgraph's trainers run (packgraph.graphs.recorder): chained
    stacks replay only on the stream they were recorded on. A test marked ``default_stream`` runs on the default
    stream instead."""
    if not torch.cuda.is_available() or request.node.get_closest_marker("default_stream"):
        yield
        return
    from packgraph.graphs import loop_stream

    with loop_stream("cuda"):
        yield
