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


# The modules that take minutes on two cores (--durations), longest first; only the order of the run depends on it.
LONGEST = ("tests.local.test_warmup", "tests.containers.test_sbatch_e2e", "tests.aligner.test_trainer_e2e",
           "tests.local.test_ablate", "tests.megatron.test_refit_vllm", "tests.aligner.test_actor_loss")


def pytest_collection_modifyitems(config, items):
    """The longest modules first, then the others with slow tests (a stable sort), so that the two workers of
    scripts/test.sh end together instead of one starting a long module last; skip device tests on a machine
    without CUDA, with the reason in the report."""
    slow = {item.module.__name__ for item in items if "slow" in item.keywords}

    def rank(item):
        name = item.module.__name__
        return LONGEST.index(name) if name in LONGEST else len(LONGEST) + (name not in slow)

    items.sort(key=rank)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run tests/gpu/ on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
