import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # Ops on models this small are too short to split across threads: a second thread only adds synchronization.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
