"""Test-wide settings. Two cores oversubscribed by torch threads make timings erratic: one thread per process."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def pytest_collection_modifyitems(config, items):
    """Skip device tests on a machine without CUDA, with the reason in the report."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run tests/gpu/ on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
