import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass
