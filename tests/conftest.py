"""Shared test setup: the `gpu` marker and a freshly seeded random generator.

Tests marked `gpu` skip themselves, with the reason, where no GPU, driver, runtime extension or
built kernels are found. The check runs once, and only when such tests were collected, so a CPU
run never touches CUDA.
"""

import os

import numpy as np
import pytest

from strata.config import env_value


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU, its driver, strata._ext.runtime and the built kernels (skipped otherwise)")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    from strata.backends.cuda import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        skip = pytest.mark.skip(reason=f"no usable GPU: {reason}")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture
def rng():
    """A generator with a fresh seed per test; the seed is printed (shown on failure), and
    STRATA_TEST_SEED=<seed> replays it."""
    seed = int(env_value("test_seed") or int.from_bytes(os.urandom(4), "little"))
    print(f"rng seed: {seed} (replay with STRATA_TEST_SEED={seed})")
    return np.random.default_rng(seed)
