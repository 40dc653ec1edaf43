"""Expert streaming with part of experts.bin unpinned (EngineConfig.pin_limit_gib, as where the
system limits pinning), on the emulated runtime: the unpinned experts' table entries are 0, so a
kernel reading one in place fails here; their copies (cache fill, admissions, the prompt ring,
staged decode misses) go through the pinned staging ring. Logits must equal the resident runner's
bit for bit."""
import numpy as np
import pytest

from strata.config import EngineConfig
from strata.engine import memory_model
from strata.engine import planner
from strata.engine.experts.host import StagingRing
from strata.engine.llm import demo_model_path
from strata.errors import InvalidArgument
from strata.pack import open_pack
from tests.engine import fake_cuda
from tests.engine.test_expert_streaming_host import _runner, _same_run

DEMO = demo_model_path()


def _limit_gib(pack, share: float) -> float:
    return share * pack.meta["files"]["experts.bin"]["bytes"] / 2**30


def test_half_pinned_equals_resident_bit_for_bit(fake, rng):
    pack = open_pack(DEMO)
    resident, streamed = _runner(pack), _runner(pack, expert_cache="20", pin_limit_gib=_limit_gib(pack, 0.6))
    store = streamed.store
    ends = [lay["offset"] for lay in pack.meta["experts"]["layers"]]
    assert store.pinned_bytes == ends[4] and store.pinned[:4].all() and not store.pinned[4:].any()
    assert (store.table_host[~store.pinned & (store.slot_of < 0)] == 0).all()   # nothing reads them in place
    assert not streamed.use_graphs and "57% of experts.bin is pinned" in streamed.graph_error
    assert "pin_limit_gib" in streamed.graph_error and streamed.decode_misses == "staged"
    ids = rng.integers(0, pack.args.vocab_size, 58).tolist()
    _same_run(resident, streamed, ids)
    s = streamed.status()
    cache = s["expert_cache"]
    assert cache["arena_pinned_share"] == pytest.approx(ends[4] / pack.meta["files"]["experts.bin"]["bytes"])
    assert cache["arena_pinned_bytes"] == ends[4] and 0.5 < cache["arena_pinned_share"] < 0.6
    assert cache["prompt_streamed"] > 0 and cache["misses"] > 0 and cache["admitted"] > 0
    assert cache["staged_blobs"] > 0 and s["decode"]["cuda_graphs"] is False
    assert store.staging.late_fills == 0            # every copy found its blob announced, in order
    assert "graph" not in s["decode"]["host_ms"]


def test_half_pinned_small_ring_routed_chunks(fake, rng, monkeypatch):
    """A ring smaller than a layer's misses, then chunks that stage only their routed experts."""
    pack = open_pack(DEMO)
    resident = _runner(pack)
    monkeypatch.setattr(planner, "ring_slots", lambda max_blob, *a, **k: 5)
    limit = _limit_gib(pack, 0.5)
    streamed = _runner(pack, expert_cache="7", pin_limit_gib=limit)
    assert streamed.store.ring_slots == 5 and 0.4 < streamed.status()["expert_cache"]["arena_pinned_share"] < 0.5
    ids = rng.integers(0, pack.args.vocab_size, 50).tolist()
    _same_run(resident, streamed, ids, decode_steps=4)
    monkeypatch.setattr(memory_model, "stream_all_tokens", lambda args: 10**9)
    routed = _runner(pack, expert_cache="7", expert_policy="lfu", pin_limit_gib=limit)
    _same_run(resident, routed, ids, decode_steps=4)


def test_half_pinned_without_a_ring(fake, rng, monkeypatch):
    """A plan with no ring: a prompt chunk's unpinned misses are staged on the compute stream."""
    pack = open_pack(DEMO)
    resident = _runner(pack)
    monkeypatch.setattr(planner, "ring_slots", lambda max_blob, *a, **k: 0)
    streamed = _runner(pack, expert_cache="10", pin_limit_gib=_limit_gib(pack, 0.5))
    assert not streamed.store.resident and streamed.store.ring_slots == 0
    _same_run(resident, streamed, rng.integers(0, pack.args.vocab_size, 40).tolist(), decode_steps=3)


def test_staged_arm_with_a_partial_pin_copies_every_miss(fake, rng):
    pack = open_pack(DEMO)
    resident = _runner(pack)
    staged = _runner(pack, expert_cache="9", decode_misses="staged", pin_limit_gib=_limit_gib(pack, 0.5))
    assert staged.store.stage_pinned_misses and "--decode-misses staged" in staged.graph_error
    _same_run(resident, staged, rng.integers(0, pack.args.vocab_size, 30).tolist(), decode_steps=3)


def test_staging_ring_order_and_reuse(fake, rng):
    """Announced keys are filled ahead by the helpers; unannounced or out-of-order ones still land
    right; a buffer is refilled only after the event of its last copy (recorded per buffer)."""
    L, E, blob = 3, 4, 64
    source = rng.integers(0, 256, L * E * blob, dtype=np.uint8)
    offsets = (np.arange(L * E, dtype=np.uint64) * blob).reshape(L, E)
    dev, stream = fake_cuda.Device(), fake_cuda.Stream(None)
    ring = StagingRing(fake_cuda, dev, source, offsets, np.full(L, blob, np.uint64), 256, num_buffers=3)
    out = fake_cuda.DeviceBuffer(dev, L * E * blob)
    keys = [(int(k) // E, int(k) % E) for k in rng.permutation(L * E)]
    ring.expect(keys[:8])
    order = keys[:2] + keys[5:7] + keys[2:5] + keys[7:]          # out of order, then unannounced
    dst = [out.ptr + (l * E + e) * blob for l, e in order]
    for i in range(0, len(order), 3):
        ls, es = zip(*order[i:i + 3])
        ring.copy(dst[i:i + 3], ls, es, stream, expected=True)
    dev.synchronize()                   # the copies ran (STRATA_FAKE_LAG=1: only now)
    np.testing.assert_array_equal(fake_cuda.view(out.ptr, L * E * blob, np.uint8), source)
    assert ring.staged_blobs == L * E and not ring._ready and not ring._pending
    assert ring.late_fills == 2 + 4                 # keys[5:7] out of order, keys[8:] unannounced
    ring.close()


def test_pin_limit_is_validated():
    with pytest.raises(InvalidArgument, match="pin_limit_gib must be >= 0"):
        EngineConfig(pin_limit_gib=-1.0)
