"""Qwen3-Next under a VRAM budget, on the CPU (CudaRunner over tests/engine/fake_cuda): the routed
experts live in the pinned arena with a VRAM cache, admissions from the decode routing log,
zero-copy decode misses and the prompt ring (and its loan); the shared expert, the DeltaNet and
attention weights stay resident. The streamed runner must give the resident runner's logits bit for
bit, prompts and decode steps (graphs included), as tests/engine/test_expert_streaming_host.py
checks for qwen3moe: the emulated kernels read whatever bytes the expert table and the ring point
at, so a wrong slot, a stale table entry or an early reuse shows here. "top10" routes 10 of 24
experts a token, as Qwen3-Next's 10 of 512: decode takes moe_gemv (past moe_decode.cu's 8 active
experts), reading the table like the fused kernels; it is Q8_0, so prompt chunks group their
rows on the device as a quantized Qwen3-Next's do."""
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from strata.config import SamplingParams  # noqa: E402
from strata.engine import planner  # noqa: E402
from strata.engine.experts.store import BufferView  # noqa: E402
from strata.pack import open_pack  # noqa: E402
from tests.engine.test_cuda_warm_up import assert_same, observable  # noqa: E402
from tests.engine.test_expert_streaming_host import _runner, _same_run  # noqa: E402
from tests.fixtures_qwen3next import NEXT_SHAPES, make_next_pack  # noqa: E402

SHAPES = {"tiny": NEXT_SHAPES["tiny"], "top10": dict(NEXT_SHAPES["tiny"], num_experts=24, num_experts_per_tok=10)}


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("next_streaming")
    # top10 in Q8_0, as Qwen3-Next ships quantized: prompt chunks group on the device (moe_group, tensor-core
    # moe_gemm over the batch's addresses); tiny in F32: grouped on the host, one GEMM per expert
    return {name: open_pack(make_next_pack(root, shape, seed=3, name=name, qtype="Q8_0" if name == "top10" else None)[0])
            for name, shape in SHAPES.items()}


def _loan_budget(pack) -> float:
    """A budget whose ring and prompt pool come out of the cache's tail (seed 000's loan)."""
    mandatory = _runner(pack).plan.mandatory_bytes
    return (mandatory + 70 * pack.meta["max_blob"]) / 2**30      # top10: 70 of 96 slots, a 28-slot ring


@pytest.mark.parametrize("shape, cache", [("tiny", "6"), ("tiny", "0"), ("top10", "40"), ("top10", "12"),
                                          ("top10", "0")])
def test_streamed_equals_resident_bit_for_bit(fake, rng, packs, shape, cache):
    """Several cache sizes; "0" misses every expert of every step (each read zero-copy from the arena)."""
    pack = packs[shape]
    resident, streamed = _runner(pack), _runner(pack, expert_cache=cache)
    assert resident.store.resident and not streamed.store.resident and streamed.store.cache_slots == int(cache)
    assert streamed.decode_misses == "zero-copy" and streamed.use_graphs
    fake.launches.clear()
    _same_run(resident, streamed, rng.integers(0, pack.args.vocab_size, 58).tolist())
    s = streamed.status()
    c = s["expert_cache"]
    assert c["misses"] > 0 and c["prompt_streamed"] > 0 and c["arena_pinned_share"] == 1.0
    assert (c["hits"] == 0) == (cache == "0") and c["resident"] + c["admitting"] == int(cache)
    assert streamed.decode_status()["host_ms"]["graph"]["steps"] >= 6          # the graph reads the table
    if shape == "top10":
        assert {"strata_moe_group", "strata_swiglu_rows_f32"} <= set(fake.launches)    # grouped on the device          # 10 active experts a token: moe_gemv reads the table in decode
        assert any(k.startswith("strata_moe_gemv") for k in fake.launches)
        assert streamed.steps.route_log.nbytes == 4 * 8 * 10 * 4               # [layers, 8 tokens x top-10]
        assert not any(k.startswith("strata_moe_gate_up") for k in fake.launches)


def test_a_prompt_borrows_the_loan_and_gives_it_back(fake, rng, packs):
    """The budget's ring and prompt pool come out of the cache tail while a prompt runs (a frozen
    pool of the plan's bytes_needed: the qwen3next prompt path fits in it), decode gets the slots back."""
    pack = packs["top10"]
    resident, streamed = _runner(pack), _runner(pack, vram_budget_gib=_loan_budget(pack))
    store = streamed.store
    assert not store.resident and isinstance(store.ring, BufferView) and store.kept_slots < store.cache_slots
    assert store.loan_pool_bytes >= streamed.plan.bytes_needed
    lent, lend = [], store.lend

    def recording(pool_bytes=None):
        region = lend(pool_bytes)
        lent.append(0 if region is None else region.nbytes)
        return region
    store.lend = recording
    ids = rng.integers(0, pack.args.vocab_size, 60).tolist()
    _same_run(resident, streamed, ids, decode_steps=10)
    assert lent and max(lent) >= streamed.plan.bytes_needed       # the prompt's chunks ran in the lent pool
    assert not store.lent and store.stats.admitted > 0
    assert (store.slot_owner[store.kept_slots:] >= 0).any()        # decode refilled given-back slots


def test_greedy_tokens_and_a_follow_up_turn(fake, rng, packs):
    """Greedy picks on the device equal, then a follow-up turn resumes from the live DeltaNet state
    (and one from the prompt's snapshot) with the same logits on both."""
    pack = packs["top10"]
    V = pack.args.vocab_size
    resident, streamed = _runner(pack), _runner(pack, expert_cache="12")
    prompt = rng.integers(0, V, 30).tolist()
    greedy, tokens = SamplingParams(), {}
    for r in (resident, streamed):
        r.prefill(prompt, 0, logits=False)
        out = []
        for _ in range(16):
            out.append(r.pick(greedy, 0.5))
            r.decode(out[-1], logits=False)
        tokens[r] = out
    assert tokens[streamed] == tokens[resident]
    turn2 = prompt + tokens[resident] + rng.integers(0, V, 9).tolist()
    turn3 = prompt + rng.integers(0, V, 11).tolist()
    for turn, start in ((turn2, len(prompt) + 16), (turn3, len(prompt))):
        assert resident.reusable_prefix(turn) == streamed.reusable_prefix(turn) == start
        np.testing.assert_array_equal(streamed.prefill(turn, start), resident.prefill(turn, start))
        for t in rng.integers(0, V, 3).tolist():
            np.testing.assert_array_equal(streamed.decode(t), resident.decode(t))


@pytest.mark.parametrize("layout", ["streamed", "loan"])
def test_warm_up_leaves_nothing_observable(fake, rng, packs, layout):
    """warm_up on a fresh streamed runner (as the server calls it): the cache's placement, bytes and
    counters, the K/V and the DeltaNet states read as before, and a request then runs as on a cold
    twin (same logits, same counters). Mid-conversation: the states, their snapshots and the cached
    prefix are kept and the next steps are the resident runner's, bit for bit."""
    pack = packs["top10"]
    config = {"expert_cache": "12"} if layout == "streamed" else {"vram_budget_gib": _loan_budget(pack)}
    warm, cold, resident = _runner(pack, **config), _runner(pack, **config), _runner(pack)
    before, states = observable(warm), warm.kv.read_states()
    fake.launches.clear()
    warm.warm_up()
    assert "strata_gdn_chunk_scan_f32" in fake.launches and 1 in warm.graphs     # its 19-token prompt: chunked
    assert_same(before, observable(warm))
    np.testing.assert_array_equal(warm.kv.read_states(), states)
    assert warm.kv.snapshots == [] and warm.reusable_prefix([0, 1, 2]) == 0
    ids = rng.integers(0, pack.args.vocab_size, 40).tolist()
    for r in (warm, cold, resident):
        r.prefill(ids[:30], 0)
        r.decode(ids[30])
    w, c = observable(warm, addresses=False), observable(cold, addresses=False)
    for seen in (w, c):
        del seen["host_ms"]             # the warmed runner's steps are replays, the cold one's are not all
    assert_same(c, w)

    states, snapshots = warm.kv.read_states(), [(n, s.copy()) for n, s in warm.kv.snapshots]
    warm.warm_up()                      # mid-conversation
    np.testing.assert_array_equal(warm.kv.read_states(), states)
    assert [n for n, _ in warm.kv.snapshots] == [n for n, _ in snapshots] == [30]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(warm.kv.snapshots, snapshots))
    assert warm.cached_ids == ids[:31] and warm.reusable_prefix(ids) == 31
    for t in ids[31:]:
        np.testing.assert_array_equal(warm.decode(t), resident.decode(t))


def test_the_plan_streams_what_the_budget_cannot_hold(fake, packs):
    """A budget short of every expert gives a cache and a ring (the refusal is gone); the plan's
    KV counts the attention layers' cells and the DeltaNet states."""
    pack = packs["top10"]
    r = _runner(pack, vram_budget_gib=_loan_budget(pack))
    assert 0 < r.plan.cache_slots < r.plan.total_experts and r.plan.prefill_ring > 0
    assert r.plan.total_experts == 4 * 24
    cells = r.plan.max_context
    assert planner.kv_bytes(pack.args, cells, "f16", 4) == r.kv.kv.nbytes + r.kv.state_bytes()
