"""Shared test setup: the `gpu` marker, a freshly seeded random generator, and how many processes run
the suite.

Tests marked `gpu` skip themselves, with the reason, where no GPU, driver, runtime extension or
built kernels are found. The check runs once, and only when such tests were collected, so a CPU
run never touches CUDA.

pyproject.toml's addopts ask pytest-xdist for `-n auto`; pytest_xdist_auto_num_workers below makes
that a worker a core with numpy's BLAS and torch on one thread each where no GPU is present, and no
workers (one process, as before) where one is. `-n 0` runs one process anywhere, `-n N` N workers.
"""

import glob
import os

import numpy as np
import pytest

from strata.config import env_value


@pytest.hookimpl(optionalhook=True)     # pytest-xdist's hook: without the plugin, not a hook at all
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: 0 where a GPU is present (its tests share one card, and some time kernels), else a
    worker a usable core, at most 8 and one for each WORKER_GIB of available memory (a worker's peak was
    about 3 GB). Each worker's BLAS and torch then take one thread: on a 2-core host the suite took 907 s
    in one process, 1,037 s as 2 workers of 2 threads each (the cores oversubscribed), 675 s as 2
    workers of one thread each. The workers inherit the environment set here (the controller starts
    them after this hook)."""
    if glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg"):
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = min(cores, MAX_WORKERS, max(1, available_gib() // WORKER_GIB))
    if workers < 2:
        return 0
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    return workers


MAX_WORKERS, WORKER_GIB = 8, 4


def available_gib() -> int:
    """MemAvailable in GiB (Linux); elsewhere as if there were room for every worker."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) >> 20
    except OSError:
        pass
    return MAX_WORKERS * WORKER_GIB


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
