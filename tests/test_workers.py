"""How many pytest-xdist workers `-n auto` (pyproject's addopts) gets: tests/conftest.py's hook."""
import os

import pytest

from tests import conftest


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(var, "0")    # recorded, so the hook's settings go again after the test
        monkeypatch.delenv(var)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.setattr(conftest, "available_gib", lambda: 64)
    return monkeypatch


def test_a_worker_a_core_with_one_blas_thread_each_where_no_gpu_is(clean_env):
    clean_env.setattr(conftest.glob, "glob", lambda pattern: [])
    clean_env.setattr(conftest.os.path, "exists", lambda path: False)
    assert conftest.pytest_xdist_auto_num_workers(None) == 3
    assert all(os.environ[v] == "1" for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"))


def test_one_process_where_a_gpu_is(clean_env):
    clean_env.setattr(conftest.glob, "glob", lambda pattern: ["/dev/nvidia0"] if "nvidia" in pattern else [])
    assert conftest.pytest_xdist_auto_num_workers(None) == 0
    assert "OPENBLAS_NUM_THREADS" not in os.environ       # the one process keeps its BLAS threads


def test_one_process_on_one_core(clean_env):
    clean_env.setattr(conftest.glob, "glob", lambda pattern: [])
    clean_env.setattr(conftest.os.path, "exists", lambda path: False)
    clean_env.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert conftest.pytest_xdist_auto_num_workers(None) == 0


def test_workers_capped_by_memory_and_at_eight(clean_env):
    clean_env.setattr(conftest.glob, "glob", lambda pattern: [])
    clean_env.setattr(conftest.os.path, "exists", lambda path: False)
    clean_env.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert conftest.pytest_xdist_auto_num_workers(None) == 8
    clean_env.setattr(conftest, "available_gib", lambda: 9)
    assert conftest.pytest_xdist_auto_num_workers(None) == 2
    clean_env.setattr(conftest, "available_gib", lambda: 5)
    assert conftest.pytest_xdist_auto_num_workers(None) == 0       # room for one: one process


def test_available_memory_is_read():
    assert conftest.available_gib() >= 0
