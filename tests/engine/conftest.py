"""Fixtures of the engine tests: `fake` puts tests/engine/fake_cuda (numpy emulations of the
kernels) in place of the CUDA runtime, so the GPU engine's host logic runs on any machine.
STRATA_FAKE_LAG=1 runs every test using it on a device that lags the host as far as it can
(fake_cuda.lagging): a host that rewrites a pinned buffer under a queued copy, or reads one before
the copy into it has landed, shows there. STRATA_FAKE_LAG=apart (or oldest, or others) gives each stream
a queue of its own (fake_cuda.lagging's apart): work on two streams with no event between shows there."""
import os

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
    lag = os.environ.get("STRATA_FAKE_LAG")
    if lag in ("1", "apart", "oldest", "others"):   # every emulated test on a device lagging the host (apart, oldest:
        with fake_cuda.lagging(apart={"1": False, "apart": True}.get(lag, lag)):     # stream by stream)
            yield fake_cuda
    else:
        yield fake_cuda
