import os

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread: ops on tensors as small as the tests' are too short to split, and a second thread only
    adds synchronization."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_configure(config):
    """Under pytest-xdist each worker takes its share of the cores: torch's default, an intra-op thread per core in
    every worker, oversubscribes them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config, items):
    """Everything under tests/cuda/ is marked `cuda`; `cuda` tests skip on machines without CUDA."""
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if f"{os.sep}cuda{os.sep}" in str(item.fspath):
            item.add_marker(pytest.mark.cuda)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


# The engine's CPU tests run under both stand-in recorders: EagerRecorder (replays re-run the Python body) and
# OpReplayRecorder (replays run the aten ops recorded at capture and no Python, as a CUDA graph does). A test module
# that imports EagerRecorder gets each of its tests twice, the second time with that name bound to OpReplayRecorder.
_STAND_IN_DIRS = tuple(f"{os.sep}tests{os.sep}{d}{os.sep}" for d in ("graphs", "models", "integrations"))


def pytest_generate_tests(metafunc):
    from tests.eager_recorder import EagerRecorder

    module = metafunc.module
    if getattr(module, "EagerRecorder", None) is EagerRecorder and any(d in module.__file__ for d in _STAND_IN_DIRS):
        metafunc.fixturenames.append("stand_in")
        metafunc.parametrize("stand_in", ["eager", "op-replay"], indirect=True)


@pytest.fixture
def stand_in(request):
    """The stand-in recorder class the test's ``EagerRecorder`` name means (see pytest_generate_tests)."""
    from tests.eager_recorder import EagerRecorder, OpReplayRecorder

    return OpReplayRecorder if request.param == "op-replay" else EagerRecorder


@pytest.fixture(autouse=True)
def _bind_stand_in(request, monkeypatch):
    # A fixture added by pytest_generate_tests is parametrized but not instantiated unless a test asks for it.
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and "stand_in" in callspec.params:
        monkeypatch.setattr(request.module, "EagerRecorder", request.getfixturevalue("stand_in"))
