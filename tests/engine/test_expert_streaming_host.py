"""Expert streaming's host logic on the CPU (CudaRunner over tests/engine/fake_cuda): a runner whose
experts live in the pinned arena, a small VRAM cache and the prompt ring must give the resident
runner's logits bit for bit, prompts and decode steps (graphs included), whatever the ring's batch
cut, the chunk mode or the cache policy. The emulated kernels read whatever bytes the addresses in
the expert table and the ring hold, so a wrong slot, a stale entry or an early reuse shows here."""
import dataclasses

import numpy as np
import pytest

from strata.config import EngineConfig
from strata.engine import memory_model
from strata.engine import planner
from strata.engine.cuda_runner import CudaRunner
from strata.engine.llm import demo_model_path
from strata.errors import DeviceError, InvalidArgument
from strata.pack import open_pack
from tests.engine import fake_cuda

DEMO = demo_model_path()


def _runner(pack, ctx=96, **config):
    return CudaRunner(pack, ctx, EngineConfig(device="cuda", prefill="24", **config))


def _same_run(resident, streamed, ids, decode_steps=8):
    np.testing.assert_array_equal(streamed.logits_all(ids), resident.logits_all(ids))
    np.testing.assert_array_equal(streamed.prefill(ids[:-decode_steps], 0), resident.prefill(ids[:-decode_steps], 0))
    for t in ids[-decode_steps:]:
        np.testing.assert_array_equal(streamed.decode(t), resident.decode(t))


def test_streamed_equals_resident_bit_for_bit(fake, rng):
    pack = open_pack(DEMO)
    resident, streamed = _runner(pack), _runner(pack, expert_cache="20")
    assert resident.store.resident and not streamed.store.resident
    assert streamed.store.cache_slots == 20 and streamed.store.ring_slots == 6 * 16
    ids = rng.integers(0, pack.args.vocab_size, 58).tolist()
    _same_run(resident, streamed, ids)
    s = streamed.status()
    cache = s["expert_cache"]
    assert s["prefill_ring"] == 96 and s["gpu"]["ring_bytes"] == 96 * streamed.store.slot_bytes
    assert cache["misses"] > 0 and cache["hits"] > 0 and cache["prompt_streamed"] > 0
    assert cache["admitted"] > 0 and cache["resident"] + cache["admitting"] == 20 and cache["arena_pinned_share"] == 1.0
    assert s["bytes_h2d"] > cache["prompt_streamed"] * 0.5 * pack.meta["max_blob"]
    assert streamed.decode_status()["host_ms"]["graph"]["steps"] >= 6      # the graph follows the table


def test_ring_smaller_than_a_layer_and_routed_only_chunks(fake, rng, monkeypatch):
    pack = open_pack(DEMO)
    resident = _runner(pack)
    monkeypatch.setattr(planner, "ring_slots", lambda max_blob, *a, **k: 5)    # 16 missing experts -> 4 batches
    streamed = _runner(pack, expert_cache="7")
    assert streamed.store.ring_slots == 5
    ids = rng.integers(0, pack.args.vocab_size, 50).tolist()
    fake.launches.clear()
    _same_run(resident, streamed, ids, decode_steps=4)
    assert {"strata_moe_group", "strata_swiglu_rows_f32"} <= set(fake.launches)     # grouped on the device
    monkeypatch.setattr(memory_model, "stream_all_tokens", lambda args: 10**9)   # stage routed experts only
    routed = _runner(pack, expert_cache="7", expert_policy="lfu")
    fake.launches.clear()
    _same_run(resident, routed, ids, decode_steps=4)
    assert "strata_swiglu_f32" in fake.launches             # the routing read on the host, per batch
    assert routed.store.stats.prompt_streamed < streamed.store.stats.prompt_streamed


def test_no_expert_cached(fake, rng):
    pack = open_pack(DEMO)
    resident, streamed = _runner(pack), _runner(pack, expert_cache="0")
    assert streamed.store.cache_slots == 0
    _same_run(resident, streamed, rng.integers(0, pack.args.vocab_size, 40).tolist(), decode_steps=3)
    assert streamed.status()["expert_cache"]["hits"] == 0


def test_decode_misses_read_in_place_are_counted_as_bus_bytes(fake, rng):
    """A one-token step's missed experts are distinct, each read in place once: bytes_in_place is
    misses x blob (bench's PCIe column counts them beside the copies; it showed 2% of the pinned rate
    for a decode reading half of it in place). Staged misses are copies instead, resident steps none."""
    pack = open_pack(DEMO)
    blobs = {lay["blob_bytes"] for lay in pack.meta["experts"]["layers"]}
    assert len(blobs) == 1
    blob = blobs.pop()
    for runner in (_runner(pack, expert_cache="0"), _runner(pack)):
        runner.prefill(rng.integers(0, pack.args.vocab_size, 12).tolist(), 0)
        st = runner.store.stats
        m0, b0 = st.misses, st.bytes_in_place
        for t in rng.integers(0, pack.args.vocab_size, 3).tolist():
            runner.decode(int(t))
        if runner.store.resident:
            assert st.misses == m0 and st.bytes_in_place == 0
        else:
            assert st.misses > m0 and st.bytes_in_place - b0 == (st.misses - m0) * blob


def test_routing_profile_starts_the_cache_warm(fake, rng, tmp_path):
    pack = open_pack(DEMO)
    path = tmp_path / "routing.npy"
    first = _runner(pack, expert_cache="10", expert_profile=str(path))
    for t in rng.integers(0, pack.args.vocab_size, 6).tolist():
        first.decode(t)
    first.save_profile()
    counts = np.load(path)
    assert counts.shape == (7, 16) and counts.sum() == 6 * 4 * 6   # 6 main layers: no step runs the MTP layer
    assert not counts[6].any()
    second = _runner(pack, expert_cache="10", expert_profile=str(path))
    hottest = set(np.argsort(-counts.reshape(-1), kind="stable")[:10].tolist())
    assert {int(k) for k in second.store.slot_owner} == hottest
    np.save(path, np.zeros((3, 3)))
    with pytest.raises(InvalidArgument, match="routing profile of shape"):
        _runner(pack, expert_cache="10", expert_profile=str(path))


def _pinning_refused_over(limit: int):
    """fake_cuda.HostBuffer as a system that refuses mapped pinned allocations over `limit` bytes."""
    class Limited(fake_cuda.HostBuffer):
        def __init__(self, device, nbytes, mapped=False):
            if mapped and nbytes > limit:
                raise DeviceError("cuMemHostAlloc: CUDA_ERROR_OUT_OF_MEMORY (out of memory)")
            super().__init__(device, nbytes, mapped)
    return Limited


def test_pinning_refused_falls_back_to_a_partial_pin(fake, rng, monkeypatch, capsys):
    """The system refuses to pin more than 5 MB: the arena pins the layers that fit (one of seven
    here), the rest is staged through pinned buffers, the same logits bit for bit."""
    pack = open_pack(DEMO)
    resident = _runner(pack)
    monkeypatch.setattr(fake_cuda, "HostBuffer", _pinning_refused_over(5_000_000))
    streamed = _runner(pack, expert_cache="10")
    assert "pinning 0.009 GiB was refused" in capsys.readouterr().err
    cache = streamed.status()["expert_cache"]
    assert cache["arena_pinned_bytes"] == pack.meta["experts"]["layers"][1]["offset"]
    assert cache["arena_pinned_share"] == pytest.approx(1 / 7)
    assert not streamed.use_graphs and "refused" in streamed.graph_error
    _same_run(resident, streamed, rng.integers(0, pack.args.vocab_size, 40).tolist(), decode_steps=3)
    assert streamed.status()["expert_cache"]["staged_blobs"] > 0


def test_no_pin_at_all_still_runs(fake, rng, monkeypatch):
    """Every mapped allocation refused: nothing is pinned, every expert copy goes through staging."""
    pack = open_pack(DEMO)
    resident = _runner(pack)
    monkeypatch.setattr(fake_cuda, "HostBuffer", _pinning_refused_over(0))
    streamed = _runner(pack, expert_cache="10")
    assert streamed.store.arena is None and streamed.status()["expert_cache"]["arena_pinned_share"] == 0.0
    assert streamed.decode_misses == "staged" and "0% of experts.bin is pinned" in streamed.graph_error
    _same_run(resident, streamed, rng.integers(0, pack.args.vocab_size, 30).tolist(), decode_steps=3)


def test_bad_policy_is_refused():
    with pytest.raises(InvalidArgument, match="expert_policy"):
        EngineConfig(expert_policy="fifo")


def test_slots_a_prompt_gave_back_empty_take_a_steps_misses_at_once(fake, rng):
    """After a prompt whose loan emptied the cache, the first decode step queues every miss it had
    (24 on the demo: 6 layers x top-4) into the empty slots, not ADMIT_PER_STEP (16) of them: an
    empty slot costs no victim. Victims stay capped at ADMIT_PER_STEP a step."""
    from strata.engine.experts import admissions
    pack = open_pack(DEMO)
    resident = _runner(pack)
    streamed = _runner(pack, vram_budget_gib=(resident.plan.mandatory_bytes + 15_000_000) / 2**30)
    store = streamed.store
    ids = rng.integers(0, pack.args.vocab_size, 56).tolist()
    np.testing.assert_array_equal(streamed.prefill(ids[:50], 0), resident.prefill(ids[:50], 0))
    assert store.cached == 0 and store._free_slots().size >= 24       # the loan gave every slot back empty
    np.testing.assert_array_equal(streamed.decode(ids[50]), resident.decode(ids[50]))
    assert store.stats.decode_misses == 24 and store.admissions.admitting == 24 > admissions.ADMIT_PER_STEP
    for t in ids[51:]:
        np.testing.assert_array_equal(streamed.decode(t), resident.decode(t))
        assert store.admissions.admitting <= max(admissions.ADMIT_PER_STEP, store._free_slots().size)


def test_gemv_decode_path_streams_too(fake, rng):
    pack = open_pack(DEMO)
    off = "fused-decode"                                             # moe_gemv + swiglu + combine
    resident, streamed = _runner(pack, kernels_off=off), _runner(pack, expert_cache="9", kernels_off=off)
    _same_run(resident, streamed, rng.integers(0, pack.args.vocab_size, 30).tolist(), decode_steps=3)
    assert "strata_moe_gemv_q8_0" in fake.launches and "strata_moe_gate_up_q8_0" not in fake.launches


def test_the_prompt_borrows_the_cache_tail_and_gives_it_back(fake, rng):
    """A budget where the ring and the prompt pool come out of the cache (seed 000's loan): they
    live in the tail slots while a prompt runs; decode gets every slot back (admissions refill them)."""
    from strata.engine.experts.store import BufferView
    pack = open_pack(DEMO)
    resident = _runner(pack)
    budget = (resident.plan.mandatory_bytes + 15_000_000) / 2**30
    streamed = _runner(pack, vram_budget_gib=budget)
    store = streamed.store
    assert not store.resident and isinstance(store.ring, BufferView) and store.kept_slots < store.cache_slots
    assert store.loan_pool_bytes >= streamed.plan.bytes_needed
    ids = rng.integers(0, pack.args.vocab_size, 60).tolist()
    _same_run(resident, streamed, ids, decode_steps=10)
    assert not store.lent and store.stats.admitted > 0
    assert (store.slot_owner[store.kept_slots:] >= 0).any()        # decode refilled given-back slots
    lent_from, lend = [], store.lend

    def recording(pool_bytes=None):
        region = lend(pool_bytes)
        lent_from.append((store.lent_from, 0 if region is None else region.nbytes))
        return region
    store.lend = recording
    streamed.prefill(ids[:12], 0)                                   # a short prompt borrows less
    streamed.prefill(ids, 0)                                        # a prompt of the plan's chunk or more
    (short_from, short_pool), (long_from, long_pool) = lent_from
    assert long_from == store.kept_slots and long_pool >= streamed.plan.bytes_needed
    assert short_from > long_from and 0 < short_pool < long_pool


def test_staged_decode_misses_give_the_same_logits(fake, rng):
    """--decode-misses staged (each layer's routing on the host, missed experts copied into staging
    slots first; eager): the comparison arm of zero-copy, the same logits bit for bit."""
    pack = open_pack(DEMO)
    resident, staged = _runner(pack), _runner(pack, expert_cache="9", decode_misses="staged")
    assert not staged.use_graphs and "staged" in staged.graph_error
    _same_run(resident, staged, rng.integers(0, pack.args.vocab_size, 40).tolist(), decode_steps=5)
    assert staged.status()["expert_cache"]["misses"] > 0


def test_the_ring_forgets_old_batches(fake, rng):
    """A server reads prompt after prompt: the ring's batch history (and its events) stays bounded."""
    pack = open_pack(DEMO)
    streamed = _runner(pack, expert_cache="7")
    sizes = []
    for _ in range(6):
        streamed.prefill(rng.integers(0, pack.args.vocab_size, 50).tolist(), 0)
        sizes.append(len(streamed.store.prompts._history))
    assert max(sizes) <= 2 * pack.args.num_hidden_layers + 2 and sizes[-1] <= sizes[1]


def _forward(runner, ids, plan, fake):
    """The runner's model over ids from position 0 with this plan -> the last row's logits [V]."""
    fake.launches.clear()
    positions = runner.ops.upload_positions(np.arange(len(ids)))
    logits, _ = runner.model.forward(np.asarray(ids), positions, runner.kv, logits_rows=slice(-1, None), plan=plan)
    return runner.ops.to_host(logits)[-1]


def test_the_chunk_plan_given_to_forward_decides_what_streams(fake, rng):
    """ops.moe reads a prompt chunk's experts from the MoePlan that model.forward carries, never from
    an engine object: every layer asks the plan's batches; a plan streaming every non-cached expert
    (grouped on the device) and one streaming the routed experts only (grouped on the host) give
    the runner's logits bit for bit, streaming different numbers of blobs; wrong addresses in the
    plan's batches change the logits."""
    pack = open_pack(DEMO)
    runner = _runner(pack, expert_cache="7")
    store, L = runner.store, pack.args.num_hidden_layers
    assert not hasattr(runner.ops, "experts")
    ids = rng.integers(0, pack.args.vocab_size, 24).tolist()
    want = runner.prefill(ids, 0)

    before = store.stats.prompt_streamed           # a stream-all chunk queues its copies when it begins
    every, asked = store.chunk_plan(len(ids), 1, L), []

    def recording(layer, active):
        asked.append(layer)
        yield from every.batches(layer, active)
    np.testing.assert_array_equal(_forward(runner, ids, dataclasses.replace(every, batches=recording), fake), want)
    assert every.stream_all and asked == list(range(L)) and "strata_moe_group" in fake.launches
    streamed_all, before = store.stats.prompt_streamed - before, store.stats.prompt_streamed

    routed = store.chunk_plan(len(ids), 10**9, L)          # below its stream-all length: routed experts only
    np.testing.assert_array_equal(_forward(runner, ids, routed, fake), want)
    assert not routed.stream_all and "strata_moe_group" not in fake.launches and "strata_swiglu_f32" in fake.launches
    assert 0 < store.stats.prompt_streamed - before < streamed_all
    with pytest.raises(InvalidArgument, match="after the next chunk began"):
        next(every.batches(0, [0]))                        # a plan lives as long as its chunk

    base = store.chunk_plan(len(ids), 10**9, L)

    def rotated(layer, active):                            # each batch's addresses one expert off
        for batch, blobs in base.batches(layer, active):
            yield batch, blobs[1:] + blobs[:1]
    assert not np.array_equal(_forward(runner, ids, dataclasses.replace(base, batches=rotated), fake), want)


def test_decode_steps_carry_their_plan(fake, rng):
    """A decode step's plan holds the routing log's address and, when misses are staged, the stager:
    the step asks it for each layer's table row; a streamed step without staging stages nothing."""
    pack = open_pack(DEMO)
    zero_copy, staged = _runner(pack, expert_cache="9"), _runner(pack, expert_cache="9", decode_misses="staged")
    plan = zero_copy.steps.plan
    assert plan.route_log == zero_copy.steps.route_log.ptr and plan.stage is None and not plan.resident
    assert staged.steps.plan.stage is not None
    ids = rng.integers(0, pack.args.vocab_size, 6).tolist()
    staged.prefill(ids[:-1], 0)
    asked = []

    def recording(layer, routed):
        asked.append((layer, routed.size))
        return staged.steps.plan.stage(layer, routed)
    step = dataclasses.replace(staged.steps.plan, stage=recording)
    fake.launches.clear()
    ids_dev, pos_dev = staged.steps.stage_inputs(ids[-1:], [len(ids) - 1], [0])
    logits, _ = staged.model.forward(ids_dev, pos_dev, staged.kv, plan=step)
    A = pack.args.num_experts_per_tok
    assert asked == [(l, A) for l in range(pack.args.num_hidden_layers)]
    resident = _runner(pack)
    resident.prefill(ids[:-1], 0)
    np.testing.assert_array_equal(staged.ops.to_host(logits)[-1], resident.decode(ids[-1]))


def test_steps_queued_without_a_pick_all_reach_the_cache(fake, rng):
    """decode(logits=False) steps in a row (a hybrid's --parallel slots in turn do the same), nothing
    synchronizing the stream between them, on a device lagging the host (fake_cuda.lagging: each
    step's routing lands in the pinned buffer when its copy runs): every step's routing reaches the
    cache, its admissions and the routing profile, as when each step is picked. Each step's copy
    once overwrote the routing of the step queued before, which the host had not read yet: only
    the last step before a pick counted."""
    pack = open_pack(DEMO)
    ids = rng.integers(0, pack.args.vocab_size, 20).tolist()
    queued, picked = _runner(pack, expert_cache="9"), _runner(pack, expert_cache="9")
    with fake.lagging():
        queued.prefill(ids[:9], 0, logits=False)
        for t in ids[9:-1]:
            queued.decode(t, logits=False)
        got = queued.decode(ids[-1])
    picked.prefill(ids[:9], 0, logits=False)
    for t in ids[9:-1]:
        picked.decode(t)
    np.testing.assert_array_equal(got, picked.decode(ids[-1]))
    assert queued.store.uses.sum() == 11 * pack.args.num_hidden_layers * pack.args.num_experts_per_tok
    np.testing.assert_array_equal(queued.store.uses, picked.store.uses)
    assert queued.store.status() == picked.store.status() and queued.store.stats.admitted > 0


def test_a_streamed_prompt_lets_other_slots_decode_between_its_chunks(fake, rng):
    """Under a budget with --parallel, a long prompt takes a loan per chunk and pauses between them, so
    a short request in the other slot is answered before the long one's first token; both replies are
    those of each request alone."""
    from strata import LLM
    from strata.config import SamplingParams
    from strata.engine.scheduler import Request
    pack = open_pack(DEMO)
    probe = CudaRunner(pack, 128, EngineConfig(device="cuda", prefill="24", parallel=2))
    budget = (probe.plan.mandatory_bytes + 15_000_000) / 2**30
    two = LLM(device="cuda", parallel=2, prefill="24", vram_budget_gib=budget, max_context=128)
    one = LLM(device="cuda", parallel=1, prefill="24", vram_budget_gib=budget, max_context=128)
    store = two.runner.store
    assert not store.resident and not two.runner.interleaves
    two.tokenizer.eos_token_ids = one.tokenizer.eos_token_ids = []
    lends, lend = [], store.lend

    def counting(pool_bytes=None):
        lends.append(pool_bytes)
        return lend(pool_bytes)
    store.lend = counting
    V = pack.args.vocab_size
    long_ids, short_ids = rng.integers(10, V, 100).tolist(), rng.integers(10, V, 5).tolist()
    long = two.scheduler.submit(Request(long_ids, SamplingParams(max_tokens=4)))
    short = two.scheduler.submit(Request(short_ids, SamplingParams(max_tokens=3)))
    while two.scheduler.step():
        pass
    assert short.finished < long.first_token                   # not held behind the whole prompt
    assert len(lends) >= 5 and not store.lent                  # a loan per 24-token chunk, all given back
    assert long.completion.token_ids == one.generate(long_ids, max_tokens=4).token_ids
    assert short.completion.token_ids == one.generate(short_ids, max_tokens=3).token_ids


def test_dq_path_over_streamed_batches_in_groups(fake, rng, monkeypatch):
    """tma-gemm over a streamed chunk's ring batches (5 experts a batch), each cut into groups of 2
    experts (DQ_SCRATCH_BYTES lowered; DQ_MIN_ROWS lowered for the demo's short prompt): f16 rows from
    the ring's slots, multiplied by the TMA GEMM through maps over each group's scratch, the same logits
    as the resident runner with the path off."""
    import strata.backends.cuda.moe as moe
    import strata.backends.cuda.ops_dense as ops_dense
    pack = open_pack(DEMO)
    a = pack.args
    per_expert = 2 * 3 * a.moe_intermediate_size * a.hidden_size        # f16 gate|up and down
    resident = _runner(pack, kernels_off="tma-gemm")
    for module in (moe, ops_dense):
        monkeypatch.setattr(module, "DQ_MIN_ROWS", 1)
    monkeypatch.setattr(moe, "DQ_SCRATCH_BYTES", 2 * per_expert)
    monkeypatch.setattr(moe, "DQ_MIN_GROUP", 1)
    monkeypatch.setattr(planner, "ring_slots", lambda max_blob, *args, **k: 5)
    streamed = _runner(pack, expert_cache="7")
    ids = rng.integers(0, pack.args.vocab_size, 50).tolist()
    fake.launches.clear()
    _same_run(resident, streamed, ids, decode_steps=4)
    groups = [n for n in fake.launches if n.startswith("strata_dequant_h_groups_")]
    assert len(groups) >= 2 * a.num_hidden_layers * 3        # several groups a layer, two matrices each
    assert "strata_moe_gemm_wst_f16" in fake.launches
    assert streamed.store.stats.prompt_streamed > 0
