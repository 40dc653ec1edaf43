"""--pcie-gbs on the emulated runtime: every batch of expert copies is bracketed by the throttle's
stamp and wait, the wait is the batch's bytes at the capped rate, zero-copy decode misses queue a
sleep, and the logits are those of the uncapped run (the cap only delays)."""
import numpy as np
import pytest

from strata.config import EngineConfig
from strata.engine.cuda_runner import CudaRunner
from strata.engine.llm import LLM, demo_model_path
from strata.errors import InvalidArgument
from strata.pack import open_pack

CAP = 2.5     # GB/s


def _runner(pack, **config):
    return CudaRunner(pack, 96, EngineConfig(device="cuda", prefill="24", expert_cache="9", **config))


def test_capped_copies_are_paced_and_change_no_logit(fake, rng):
    pack = open_pack(demo_model_path())
    ids = rng.integers(0, pack.args.vocab_size, 40).tolist()
    free = _runner(pack)
    want = free.logits_all(ids)
    assert not fake.bus_calls
    capped = _runner(pack, pcie_gbs=CAP)
    fake.bus_calls.clear()                  # the cache's first fill is paced too, and counted as setup
    np.testing.assert_array_equal(capped.logits_all(ids), want)
    stamps = [c for c in fake.bus_calls if c[0] == "stamp"]
    waits = [c for c in fake.bus_calls if c[0] == "wait"]
    assert stamps and len(stamps) == len(waits)
    cap = capped.store.bus_cap
    assert cap.paced_bytes == capped.store.stats.bytes_h2d > 0
    assert sum(w[2] for w in waits) == pytest.approx(cap.paced_bytes / CAP, rel=1e-3)
    fake.bus_calls.clear()
    capped.prefill(ids[:20], 0)
    for t in ids[20:24]:
        capped.decode(t)
    assert capped.status()["expert_cache"]["bus_cap"]["pcie_gbs"] == CAP


def test_zero_copy_misses_queue_a_sleep(fake, rng):
    pack = open_pack(demo_model_path())
    capped = _runner(pack, pcie_gbs=CAP, decode_misses="zero-copy")
    capped.prefill(rng.integers(0, pack.args.vocab_size, 20).tolist(), 0)
    fake.bus_calls.clear()
    for t in rng.integers(0, pack.args.vocab_size, 4).tolist():
        capped.decode(int(t))
    sleeps = [c[1] for c in fake.bus_calls if c[0] == "sleep"]
    assert sleeps and all(ns > 0 for ns in sleeps)     # 9 of 112 experts cached: every step misses


def test_the_cap_is_refused_where_it_cannot_apply():
    with pytest.raises(InvalidArgument, match="pcie_gbs must be >= 0"):
        EngineConfig(pcie_gbs=-1)
    with pytest.raises(InvalidArgument, match="--pcie-gbs caps the GPU"):
        LLM(device="cpu", pcie_gbs=25)
