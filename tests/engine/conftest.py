"""Fixtures of the engine tests: `fake` puts tests/engine/fake_cuda (numpy emulations of the
kernels) in place of the CUDA runtime, so the GPU engine's host logic runs on any machine."""
import pytest

import strata.backends.cuda as cuda_backend
from tests.engine import fake_cuda


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(cuda_backend, "_runtime", lambda: fake_cuda)
    monkeypatch.setattr(cuda_backend, "_graphs", lambda: fake_cuda)
    fake_cuda.launches.clear()
    fake_cuda.graph_launches.clear()
    fake_cuda.pdl_launches.clear()
    fake_cuda.bus_calls.clear()
    return fake_cuda
