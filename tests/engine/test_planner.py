"""The VRAM planner (strata.engine.planner), its model of the prompt path's memory
(strata.engine.memory_model) checked against CudaRunner on the emulated runtime, and `strata plan`."""
import json

import pytest

import strata.backends.cuda as cuda_backend
from strata import cli
from strata.backends.cuda.memory import Pool
from strata.config import KV_VRAM_SLACK, EngineConfig
from strata.engine import memory_model, planner
from strata.engine.cuda_runner import CudaRunner
from strata.engine.llm import demo_model_path
from strata.engine.planner import (RING_BUDGET_BYTES, RING_MIN_SLOTS, ExpertCache, PackSizes, bytes_needed,
                                   chunk_candidates, kv_bytes, largest_fitting, make_plan, ring_slots,
                                   vram_budget)
from strata.errors import DeviceError, InvalidArgument
from strata.pack import open_pack
from strata.plan import plan_sizes

SCAN_STEP = 2048        # the scans' chunk grid (planner.CHUNK_GRID patched to it): coarse, so a build without
GRID = list(range(SCAN_STEP, 32768 + 1, SCAN_STEP))   # strata._ext.prompt_plan (a dry run, ~0.5 s a point) stays quick
CONTEXT = 1024          # of the emulated runners


@pytest.fixture(scope="module")
def q30():
    return plan_sizes(None, "qwen3-30b-a3b")[1]


@pytest.fixture(scope="module")
def q30_needs(q30):
    """bytes_needed over the scan grid, for the brute-force scans."""
    return {T: bytes_needed(q30, T) for T in GRID}


def demo_sizes(pack=None):
    pack = pack or open_pack(demo_model_path())
    return PackSizes.from_meta(pack.meta, pack.meta["files"]["dense.bin"]["bytes"])


def config(**kw):
    return EngineConfig(**{"max_context": 40960, **kw})       # the shape's trained context


def mandatory(sizes, cfg):
    return sum(planner.mandatory_items(sizes, cfg).values())


# ---- the seed's arithmetic -------------------------------------------------------------------------

def test_ring_slots_are_a_byte_budget():
    assert RING_BUDGET_BYTES == 384 * 1_382_400 == 530_841_600
    assert [ring_slots(b) for b in (1_382_400, 2_663_424, 5_222_400)] == [384, 199, 101]
    fused = 1024 * 1_382_400                # the fused path's budget, capped by its ring_cap
    assert [ring_slots(b, fused, hi=1024) for b in (1_382_400, 5_222_400)] == [1024, 271]
    assert ring_slots(2_663_424, fused) == 512                       # 531, held to the native cap
    assert ring_slots(64 << 20) == RING_MIN_SLOTS and ring_slots(4096) == 512


def test_kv_bytes_per_type(q30):
    a = q30.args
    values = 2 * 48 * 1000 * a.num_key_value_heads * a.head_dim
    assert kv_bytes(a, 1000, "f16", 48) == 2 * values
    assert kv_bytes(a, 1000, "int8", 48) == values // 64 * 66
    assert kv_bytes(a, 1000, "q4_0", 48) == values // 32 * 18
    assert kv_bytes(a, 1000, "k8v4", 48) == values // 2 // 64 * 66 + values // 2 // 32 * 18
    # --kv-resident below the context: every cell in pinned host memory, the newest N also in the VRAM
    # window (priced as mandatory KV, with the ring's slack); decode reads the cells older than the
    # window over the bus
    small = make_plan(q30, config(max_context=8192, kv_resident=2048, kv="q4_0"), 8 << 30)
    assert small.kv_cells == 2048 and small.mandatory["kv"] == kv_bytes(a, 2048 + KV_VRAM_SLACK, "q4_0", 48)
    assert small.kv_host_bytes == kv_bytes(a, 8192, "q4_0", 48)
    assert small.kv_bus_bytes_per_token == kv_bytes(a, 8192 - 2048, "q4_0", 48)
    tiny = make_plan(q30, config(max_context=8192, kv_resident=16, kv="q4_0"), 8 << 30)
    assert tiny.mandatory["kv"] < small.mandatory["kv"] and tiny.cache_slots >= small.cache_slots
    whole = make_plan(q30, config(max_context=8192, kv_resident=8192, kv="q4_0"), 8 << 30)
    assert whole.kv_cells == 8192 and whole.mandatory["kv"] == kv_bytes(a, 8192, "q4_0", 48)
    assert whole.kv_host_bytes == whole.kv_bus_bytes_per_token == 0


def test_expert_cache_counts_each_layer_at_its_own_blob(q30, rng):
    layers = [dict(lay, blob_bytes=int(rng.integers(1, 5)) * 1_000_000) for lay in q30.layers]
    sizes = PackSizes(q30.args, q30.dense_bytes, q30.dense, tuple(layers), max(l["blob_bytes"] for l in layers))
    cache = ExpertCache(sizes)
    for n in rng.integers(0, cache.total_slots, 20).tolist():
        assert cache.nbytes(n) == sum(layers[i % 48]["blob_bytes"] for i in range(n))
        b = int(rng.integers(0, 10**10))
        k = cache.slots_within(b)
        assert cache.nbytes(k) <= b and (k == cache.total_slots or cache.nbytes(k + 1) > b)
    plan = make_plan(sizes, config(), 12 << 30)
    room = plan.vram_budget_bytes - plan.mandatory_bytes
    assert plan.cache_slots == cache.slots_within(room) > room // sizes.max_blob
    # the loan is paid in the tail slots' own bytes
    left = room - plan.prompt_loan_bytes
    assert cache.nbytes(plan.prompt_cache_slots) <= left < cache.nbytes(plan.prompt_cache_slots + 1)


# ---- bytes_needed and the scan ---------------------------------------------------------------------

def test_bytes_needed_rises_with_T(q30, q30_needs):
    sizes = demo_sizes()
    peaks = [memory_model.prompt_pool_bytes(sizes, T) for T in range(9, 400)]
    assert all(b >= a for a, b in zip(peaks, peaks[1:]))          # every chunk past the GEMV path
    needs = list(q30_needs.values())
    assert all(b > a for a, b in zip(needs, needs[1:]))
    for s in (sizes, plan_sizes(None, "small")[1], plan_sizes(None, "tiny")[1]):
        grid = [bytes_needed(s, T) for T in range(256, 12 * 256 + 1, 256)]
        assert all(b > a for a, b in zip(grid, grid[1:]))
    # the reserved pool sits a few percent above the live mark
    assert 1.0 < q30_needs[4096] / memory_model.prompt_pool_bytes(q30, 4096) < 1.25     # first-fit holes


def test_largest_fitting_is_the_scan(rng):
    for _ in range(200):
        cands = sorted(set(rng.integers(1, 10**6, int(rng.integers(1, 60))).tolist()))
        limit = int(rng.integers(0, 10**6 + 2))
        calls = []

        def fits(c):
            calls.append(c)
            return c <= limit
        want = max((c for c in cands if c <= limit), default=None)
        assert largest_fitting(cands, fits) == want
        assert len(calls) <= len(cands).bit_length()


def test_auto_chunk_equals_a_scan_of_the_grid(q30, q30_needs, rng, monkeypatch):
    monkeypatch.setattr(planner, "bytes_needed", lambda s, T, *a: q30_needs[T])
    monkeypatch.setattr(planner, "CHUNK_GRID", SCAN_STEP)
    cfg = config(prefill="auto:32768", prefill_rule="bytes")
    fixed = mandatory(q30, cfg)
    full = ring_slots(q30.max_blob)
    lo, hi = q30_needs[SCAN_STEP] + full * q30.max_blob, q30_needs[32768] + full * q30.max_blob
    for room in rng.integers(lo, hi + (hi - lo) // 8, 25).tolist():
        plan = make_plan(q30, cfg, fixed + room)
        want = max(T for T in GRID if q30_needs[T] + full * q30.max_blob <= room)
        assert (plan.prefill_chunk, plan.prefill_ring) == (want, full), room
        assert plan.bytes_needed == q30_needs[want] and plan.prompt_loan_bytes <= room


def test_no_full_ring_falls_back_to_the_floor(q30, q30_needs, monkeypatch):
    monkeypatch.setattr(planner, "bytes_needed", lambda s, T, *a: q30_needs[T])
    monkeypatch.setattr(planner, "CHUNK_GRID", SCAN_STEP)
    cfg = config(expert_cache="0", prefill_rule="bytes")
    mb, full = q30.max_blob, ring_slots(q30.max_blob)
    room = q30_needs[SCAN_STEP] + (full - 1) * mb           # not even 256 tokens beside a full ring
    plan = make_plan(q30, cfg, mandatory(q30, cfg) + room)
    want = max(T for T in GRID if q30_needs[T] + RING_MIN_SLOTS * mb <= room)
    assert want >= SCAN_STEP and plan.prefill_chunk == want and "floor" in plan.prefill_rule
    assert RING_MIN_SLOTS <= plan.prefill_ring == (room - q30_needs[want]) // mb < full
    room = q30_needs[SCAN_STEP] + RING_MIN_SLOTS * mb + 1
    plan = make_plan(q30, cfg, mandatory(q30, cfg) + room)
    assert (plan.prefill_chunk, plan.prefill_ring) == (SCAN_STEP, RING_MIN_SLOTS)


def test_ceiling_fixed_chunk_and_context(q30):
    for rule in ("bytes", "auto"):
        assert make_plan(q30, config(prefill="auto:1000", prefill_rule=rule), 12 << 30).prefill_chunk == 768
        assert make_plan(q30, config(prefill="auto:100", prefill_rule=rule), 12 << 30).prefill_chunk == 100
    assert make_plan(q30, config(prefill_rule="bytes"), 12 << 30).prefill_chunk > 4096
    assert make_plan(q30, config(max_context=1000), 12 << 30).prefill_chunk == 1000
    plan = make_plan(q30, config(prefill="3000"), 12 << 30)
    assert plan.prefill_chunk == 3000 and plan.prefill_rule == "fixed --prefill"
    assert plan.bytes_needed == bytes_needed(q30, 3000) and plan.prefill_ring == ring_slots(q30.max_blob)
    with pytest.raises(InvalidArgument, match="30000-token"):
        make_plan(q30, config(prefill="30000"), 6 << 30)
    with pytest.raises(InvalidArgument, match="positive"):
        chunk_candidates("auto:0", 4096)


def test_every_expert_cached_needs_no_ring(q30):
    plan = make_plan(q30, config(max_context=4096), 24 << 30)
    assert plan.cache_slots == plan.total_experts == 6144 and plan.prefill_ring == 0
    assert plan.prompt_cache_slots == 6144 and plan.pcie_bytes_per_chunk == 0 and plan.prompt_tok_s is None
    assert plan.decode_hit_rate == 1.0 and 1500 < plan.decode_tok_s < 2000     # docs/PERF.md: ~1,850


def test_too_small_budget_names_the_bytes(q30):
    cfg = config()
    need = mandatory(q30, cfg) + bytes_needed(q30, 256) + RING_MIN_SLOTS * q30.max_blob
    with pytest.raises(InvalidArgument, match=f"at least {need} bytes") as info:
        make_plan(q30, cfg, need - 1)
    assert "\n" not in str(info.value)
    assert make_plan(q30, cfg, need).prefill_ring == RING_MIN_SLOTS


def test_fixed_expert_cache(q30):
    plan = make_plan(q30, config(expert_cache="1000"), 12 << 30)
    assert plan.cache_slots == 1000 and plan.cache_bytes == 1000 * q30.max_blob
    assert make_plan(q30, config(expert_cache="99999"), 24 << 30).cache_slots == 6144
    with pytest.raises(InvalidArgument, match="--expert-cache 4000"):
        make_plan(q30, config(expert_cache="4000"), 8 << 30)


def test_vram_budget():
    assert vram_budget(EngineConfig(vram_budget_gib=8), None)[0] == 8 << 30
    with pytest.raises(InvalidArgument, match="--vram-budget-gib"):
        vram_budget(EngineConfig(), None)
    assert vram_budget(EngineConfig(), 20 << 30)[0] == 19 << 30
    assert vram_budget(EngineConfig(vram_budget_gib=8), 20 << 30)[0] == 8 << 30
    assert vram_budget(EngineConfig(vram_budget_gib=30), 20 << 30)[0] == 19 << 30


# ---- the model of the prompt path, against the emulated allocator ------------------------------------

@pytest.fixture(scope="module")
def odd_packs(tmp_path_factory):
    """A pack with F32 weights and head dim 24, and one with K-quants mixed per layer, gate and up
    of different types (the unfused MoE), F16 norms and an embedding the embed kernel lacks."""
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from tests.fixtures import SHAPES, make_gguf_pack, make_pack
    root = tmp_path_factory.mktemp("planner_packs")
    odd, _ = make_pack(root, SHAPES["odd"], seed=2, name="odd")
    qtypes = {"attn": ["F32", "Q8_0"], "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q6_K",
              "ffn_down_exps": ["Q8_0", "Q4_K"], "norm": "F16", "embd": "Q4_K", "output": "Q8_0"}
    mixed, _ = make_gguf_pack(root, SHAPES["kquant"], qtypes, seed=3, name="mixed")
    return [open_pack(odd), open_pack(mixed)]


def _prefill(pack, T: int, n: int, rng, pool=None):
    """A fresh runner reads n tokens in chunks of T; -> (runner, pool bytes in use before)."""
    runner = CudaRunner(pack, CONTEXT)
    runner.prefill_chunk = T
    if pool is not None:
        runner.ops.pool = pool(runner)
    base = runner.ops.pool.used_bytes              # inv_freq, kept for good
    runner.prefill(rng.integers(0, pack.args.vocab_size, n).tolist(), 0)
    return runner, base


@pytest.mark.parametrize("T", [1, 5, 9, 130, 300])
def test_prompt_pool_bytes_is_the_pool_peak(fake, rng, T):
    pack = open_pack(demo_model_path())
    sizes = demo_sizes(pack)
    runner, base = _prefill(pack, T, T, rng)
    assert runner.ops.pool.peak_bytes - base == memory_model.prompt_pool_bytes(sizes, T, CONTEXT, 8, resident=True)
    zeros = runner.ops._zeros.nbytes if runner.ops._zeros is not None else memory_model.ZEROS_MIN_BYTES
    assert zeros == memory_model.zeros_bytes(sizes, T)       # none below GEMV_MAX_T: decode's MoE needs none


def test_later_chunks_stay_under_the_first(fake, rng):
    """A later chunk frees the previous chunk's positions while it runs: at most the first's peak.
    (Chunks of at least stream_all_tokens group on the device, resident or streamed: one allocation plan.)"""
    pack = open_pack(demo_model_path())
    runner, base = _prefill(pack, 64, 2 * 64 + 3, rng)
    assert runner.ops.pool.peak_bytes - base <= memory_model.prompt_pool_bytes(demo_sizes(pack), 64, CONTEXT, 8)


def test_prompt_pool_bytes_other_packs(fake, rng, odd_packs):
    for pack in odd_packs:
        sizes = PackSizes.from_meta(pack.meta, pack.meta["files"]["dense.bin"]["bytes"])
        for T in (3, 12, 40):
            runner, base = _prefill(pack, T, T, rng)
            assert runner.ops.pool.peak_bytes - base == memory_model.prompt_pool_bytes(sizes, T, CONTEXT, 8, resident=True)
    assert memory_model.norm_copies_bytes(sizes) > 0 and len(runner.ops._f32_weights) > 0


@pytest.mark.parametrize("T", [9, 100])
def test_bytes_needed_is_the_smallest_reserved_pool(fake, rng, T):
    """A frozen pool of bytes_needed's pool part reads a prompt of several chunks; 256 bytes less
    does not (first-fit's holes: the live peak alone would not do). A resident runner's chunks of at
    least stream_all_tokens allocate as a streamed runner's (both group on the device)."""
    pack = open_pack(demo_model_path())
    sizes = demo_sizes(pack)
    arena = memory_model.prompt_arena_bytes(sizes, T)
    assert bytes_needed(sizes, T) == arena + memory_model.zeros_bytes(sizes, T) - memory_model.ZEROS_MIN_BYTES
    assert arena > memory_model.prompt_pool_bytes(sizes, T)

    def reserved(nbytes):
        return lambda runner: Pool(fake, runner.dev, reserve_bytes=nbytes)
    for n in (3 * T, 2 * T + int(rng.integers(1, T))):
        _prefill(pack, T, n, rng, reserved(arena))
    with pytest.raises(DeviceError, match="do not fit"):
        _prefill(pack, T, 3 * T, rng, reserved(arena - 256))


def test_decode_step_bytes_and_graph_reserve(fake, rng):
    pack = open_pack(demo_model_path())
    sizes = demo_sizes(pack)
    runner = CudaRunner(pack, 512)
    runner.prefill(rng.integers(0, 8000, 5).tolist(), 0)
    pool = runner.ops.pool
    pool.peak_bytes = base = pool.used_bytes
    runner.decode(1)
    peak, total = memory_model.decode_step_bytes(sizes, 1, 512, 8)
    assert (pool.peak_bytes - base, runner._step_bytes[1]) == (peak, total)
    runner.decode(2)
    assert runner.graphs[1].keep[0].capacity_bytes == Pool.block_bytes(total)
    items = planner.mandatory_items(sizes, EngineConfig(max_context=512), num_sms=8)
    assert items["graphs"] == Pool.block_bytes(total)


@pytest.fixture(scope="module")
def next_packs(tmp_path_factory):
    """qwen3next packs: tiny (top-2 of 4) and top-10 of 24 (moe_gemv's decode path, as Qwen3-Next's)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.fixtures_qwen3next import NEXT_SHAPES, make_next_pack
    root = tmp_path_factory.mktemp("planner_next")
    shapes = {"tiny": NEXT_SHAPES["tiny"], "top10": dict(NEXT_SHAPES["tiny"], num_experts=24, num_experts_per_tok=10)}
    return [open_pack(make_next_pack(root, shape, seed=3, name=name)[0]) for name, shape in shapes.items()]


def test_qwen3next_pool_is_the_dry_run_of_its_own_forward(fake, rng, next_packs):
    """The memory model runs qwen3next's own forward (DeltaNet layers, gated attention, the shared
    expert): a prompt chunk's pool peak, a decode step's peak and graph reserve are the runner's
    exactly (the qwen3moe stand-in it replaces priced this prompt peak 7-18% over, the graph reserve
    about half under); a frozen pool of bytes_needed's pool part reads a prompt of three chunks and
    256 bytes less does not (a streamed prompt's loan: tests/engine/test_qwen3next_streaming_host.py)."""
    for pack in next_packs:
        sizes = demo_sizes(pack)
        for T in (1, 5, 9, 40):
            runner, base = _prefill(pack, T, T, rng)
            assert runner.ops.pool.peak_bytes - base == memory_model.prompt_pool_bytes(sizes, T, CONTEXT, 8,
                                                                                         resident=True)
        runner = CudaRunner(pack, 512)
        runner.prefill(rng.integers(0, pack.args.vocab_size, 5).tolist(), 0)
        pool = runner.ops.pool
        pool.peak_bytes = base = pool.used_bytes
        runner.decode(1)
        assert (pool.peak_bytes - base, runner._step_bytes[1]) == memory_model.decode_step_bytes(sizes, 1, 512, 8)
        T = 12
        arena = memory_model.prompt_arena_bytes(sizes, T, CONTEXT, 8)
        assert bytes_needed(sizes, T, CONTEXT) == arena + memory_model.zeros_bytes(sizes, T) - memory_model.ZEROS_MIN_BYTES

        def reserved(nbytes):
            return lambda runner: Pool(fake, runner.dev, reserve_bytes=nbytes)
        _prefill(pack, T, 3 * T, rng, reserved(arena))
        with pytest.raises(DeviceError, match="do not fit"):
            _prefill(pack, T, 3 * T, rng, reserved(arena - 256))


# ---- python -m strata plan --------------------------------------------------------------------------

def _cli_json(capsys, *args):
    assert cli.main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_plan_synthetic_budgets(capsys):
    plans = [_cli_json(capsys, "--synthetic", "qwen3-30b-a3b", "--vram-budget-gib", str(g), "--device", "cpu",
                       "--max-context", "4096") for g in (8, 12, 24)]
    for key in ("max_blob", "cache_slots", "prefill_chunk", "prefill_ring", "bytes_needed", "vram_budget_bytes"):
        assert all(key in p for p in plans)
    slots = [p["cache_slots"] for p in plans]
    assert 0 < slots[0] < slots[1] < slots[2] == 6144
    assert [p["vram_budget_bytes"] for p in plans] == [8 << 30, 12 << 30, 24 << 30]
    assert plans[0]["max_blob"] == 2_654_208 and plans[0]["prefill_ring"] == 200 == plans[1]["prefill_ring"]
    assert plans[2]["prefill_ring"] == 0 and all(p["prefill_chunk"] == 4096 for p in plans)
    assert "H200 figures recorded in docs/PERF.md" in plans[0]["bandwidth_source"]
    assert cli.main(["plan", "--synthetic", "qwen3-30b-a3b", "--vram-budget-gib", "8", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "200 slots" in text and "the H200 figures recorded in docs/PERF.md (no GPU measured)" in text and "over PCIe" in text


def test_cli_plan_qwen3next_budgets(capsys):
    """Qwen3-Next-80B-A3B (48 layers of 512 experts, top-10) at 8, 12 and 24 GiB streams its experts:
    a cache of at least a token's experts in every layer, a full 300-slot ring of its 1,769,472-byte
    blobs, prompt chunks past stream_all_tokens (103); at 8 GiB the f16 KV lowers the context."""
    plans = [_cli_json(capsys, "--synthetic", "qwen3-next-80b-a3b", "--vram-budget-gib", str(g), "--device", "cpu",
                       "--prefill-rule", "bytes") for g in (8, 12, 24)]
    assert [p["total_experts"] for p in plans] == [48 * 512] * 3
    slots = [p["cache_slots"] for p in plans]
    assert 480 <= slots[0] < slots[1] < slots[2] < 48 * 512
    assert all(p["max_blob"] == 1_769_472 and p["prefill_ring"] == 300 for p in plans)
    chunks = [p["prefill_chunk"] for p in plans]
    assert 103 <= chunks[0] < chunks[1] < chunks[2] == 32768
    assert plans[0]["max_context"] < 262144 == plans[1]["max_context"] == plans[2]["max_context"]
    assert all(p["bytes_needed"] < p["vram_budget_bytes"] for p in plans)


def test_cli_plan_impossible_budget_exits_2(capsys):
    assert cli.main(["plan", "--synthetic", "qwen3-30b-a3b", "--vram-budget-gib", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "too small" in err[0] and "bytes" in err[0]


def test_cli_plan_measures_a_gpu(fake, capsys, monkeypatch):
    import strata.plan
    monkeypatch.setattr(cuda_backend, "unavailable_reason", lambda device=0: None)
    monkeypatch.setattr(strata.plan, "MEASURE_BYTES", 1 << 20)
    plan = _cli_json(capsys)                     # the demo model on the emulated 8 GiB-free GPU
    assert plan["vram_budget_bytes"] == (8 << 30) - (1 << 30) and plan["model"].endswith("demo")
    assert plan["bandwidth_source"] == "measured now on Fake GPU" and plan["h2d_gb_s"] > 0
    plan = _cli_json(capsys, "--vram-budget-gib", "2")
    assert plan["vram_budget_bytes"] == 2 << 30


def test_legacy_slots_rule_for_the_ab(q30):
    """--prefill-rule slots: 384 slots whatever the blob (1.02 GB of 2.65 MB blobs, twice the byte
    budget's 200 slots) and the first chunk of the fixed list that fits beside them."""
    budget = int(8 * 2**30)
    new = make_plan(q30, config(prefill="auto:16384", max_context=16448, prefill_rule="bytes"), budget)
    old = make_plan(q30, config(prefill="auto:16384", max_context=16448, prefill_rule="slots"), budget)
    assert new.prefill_ring == 200 and old.prefill_ring == planner.LEGACY_RING_SLOTS
    assert old.prefill_chunk in planner.LEGACY_CHUNKS and "fixed chunk list" in old.prefill_rule
    assert new.prefill_chunk % planner.CHUNK_GRID == 0 and new.prefill_chunk >= old.prefill_chunk
    with pytest.raises(InvalidArgument, match="prefill_rule"):
        config(prefill_rule="rows")


# ---- the context: the model's trained one, fitted to the budget ---------------------------------------

def test_default_context_at_8_gib_is_the_trained_40k(q30):
    """serve on qwen3-30b-a3b at --vram-budget-gib 8 must take a 13K-token prompt by default."""
    plan = make_plan(q30, EngineConfig(), 8 << 30)
    assert q30.args.max_position_embeddings == 40960
    assert plan.max_context == plan.kv_cells == 40960 and plan.context_source == "the model's trained context"
    assert plan.max_context > 13000 + 1024
    assert plan.cache_slots >= planner.min_cache_slots(q30) == 48 * 8
    assert plan.mandatory["kv"] == kv_bytes(q30.args, 40960, "f16", 48)


@pytest.mark.parametrize("gib", [3.5, 5])
def test_context_is_lowered_to_what_the_budget_holds(q30, gib):
    budget = int(gib * 2**30)
    plan = make_plan(q30, EngineConfig(), budget)
    c = plan.max_context
    assert c < 40960 and c % planner.CHUNK_GRID == 0 and plan.context_source.startswith("lowered")
    floor = ExpertCache(q30).nbytes(planner.min_cache_slots(q30))

    def room_and_need(ctx):
        cfg = EngineConfig(max_context=ctx)
        loan = bytes_needed(q30, planner.CHUNK_GRID, ctx) + RING_MIN_SLOTS * q30.max_blob
        return budget - mandatory(q30, cfg), max(floor, loan)
    room, need = room_and_need(c)
    assert room >= need and plan.cache_slots >= planner.min_cache_slots(q30)
    room, need = room_and_need(c + planner.CHUNK_GRID)      # one grid step more no longer holds it
    assert room < need


def test_max_context_flag_overrides_and_is_capped_at_the_trained_context(q30):
    assert make_plan(q30, EngineConfig(max_context=8192), 8 << 30).max_context == 8192
    capped = make_plan(q30, EngineConfig(max_context=100000), 8 << 30)
    assert capped.max_context == 40960 and "capped" in capped.context_source
    with pytest.raises(InvalidArgument, match="too small"):      # asked for, not lowered
        make_plan(q30, EngineConfig(max_context=40960), 2 << 30)


def test_what_if_prices_refused_fields_only(q30):
    with pytest.raises(InvalidArgument, match="kv-resident"):
        EngineConfig(kv_resident=64, device="cpu")
    plan = make_plan(q30, config(max_context=8192), 8 << 30, what_if={"kv": "int8"})
    assert plan.kv == "int8" and plan.mandatory["kv"] == kv_bytes(q30.args, 8192, "int8", 48)
    with pytest.raises(InvalidArgument, match="not priced"):
        make_plan(q30, config(), 8 << 30, what_if={"prefill": "1024"})


def test_cli_plan_says_the_context(capsys):
    assert cli.main(["plan", "--synthetic", "qwen3-30b-a3b", "--vram-budget-gib", "5", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "context " in out and "lowered from the model's trained 40960" in out
    assert _cli_json(capsys, "--synthetic", "qwen3-30b-a3b", "--vram-budget-gib", "8",
                     "--device", "cpu")["max_context"] == 40960


def test_batched_step_ceilings_and_the_bus_bytes_an_extra_row_adds(q30):
    # resident: nothing crosses the bus and more rows a step read the dense weights for more tokens;
    # at 12 GiB most of an extra row's experts cross the bus (what --batch-max auto then measures)
    from strata.plan import plan_text
    whole = make_plan(q30, config(parallel=8, max_context=4096), 140 << 30)
    small = make_plan(q30, config(parallel=8, batch_max=2, max_context=4096), 12 << 30)
    assert len(whole.batch_tok_s) == len(small.batch_bus_bytes) == 8 and whole.batch_max == 0
    assert set(whole.batch_bus_bytes) == {0} and list(whole.batch_tok_s) == sorted(whole.batch_tok_s)
    extra = [b - a for a, b in zip(small.batch_bus_bytes, small.batch_bus_bytes[1:])]
    assert all(e > 0 for e in extra) and extra == sorted(extra, reverse=True)     # fewer new experts each row
    assert extra[0] > 0.5 * small.batch_bus_bytes[0]
    assert "--batch-max auto" in plan_text("q30", whole) and "--batch-max 2: steps of up to 2 rows" in plan_text(
        "q30", small)
    assert "batched decode" not in plan_text("q30", make_plan(q30, config(max_context=4096), 12 << 30))
