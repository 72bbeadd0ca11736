import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Everything under tests/cuda/ is marked `cuda`; `cuda` tests skip on machines without CUDA."""
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if f"{os.sep}cuda{os.sep}" in str(item.fspath):
            item.add_marker(pytest.mark.cuda)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
