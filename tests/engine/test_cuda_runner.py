"""The GPU engine (every weight resident) against the numpy engine, on tiny packs and the demo model.

Oracle: the numpy engine at the GPU's declared precision (tests/engine/cpu_f16_kv.py): K/V rounded
through f16 before caching, and the prompt GEMMs that run on tensor cores (cuda/moe_gemm.cu, weights
of a quantized or half type) with X and W rounded to f16. Bound: max |GPU - oracle| <= REL * max
|oracle logit|. What remains is the f32 summation order, ~1 ulp sin/cos/exp/rsqrt, the f16 roundings
those last bits can flip, and the tensor-core prompt attention's f16 Q and P (cuda/attention_tc.cu:
<= 2e-3 of a head's output): up to 4.5e-4 measured over 8 seeds with the numpy emulations of the
kernels (bound 1e-3 there); REL = 3e-3 here, on the device, whose tensor-core and reduction orders
differ from numpy's more than the emulations' do, and whose prompt attention rounds Q and P to f16
(not in the oracle): 2.03e-3 was seen once (kquant-mixed, seed 3491327912) in 5 device runs. Without the f16 GEMMs in the oracle, a router whose top-k is decided by a hair
flips on these random models and moves logits by 10x that. Against the plain numpy engine (f32 K/V,
f32 GEMMs) on the trained demo model: bound 3e-3.

Decode through a CUDA graph against eager decode: bitwise. A replay runs the very kernels the eager
step launches, with the same grids and scalar arguments (the attention splits follow the cache
size; the length is read on the device); only the activation addresses differ, all 256-byte
aligned, and no decode kernel reduces in an order that depends on timing (no atomics). So every
float must come out the same, and any difference is a bug (a stale address, a missed input).
"""
import numpy as np
import pytest

import strata
from strata.config import EngineConfig
from strata.engine.cuda_runner import CudaRunner
from strata.engine.llm import demo_model_path
from strata.engine.runner import CpuRunner
from strata.pack import open_pack
from tests.engine.cpu_f16_kv import cpu_runner_f16_kv, oracle_ids

pytestmark = pytest.mark.gpu

REL = 3e-3          # against the oracle at the GPU's precision
REL_F32_KV = 3e-3   # against the plain numpy engine, demo model
GAP = 2e-3          # router top-k margin the oracle's draws must keep (tests/engine/cpu_f16_kv.oracle_ids):
                    # a near-tied router flips with rounding and moves logits 10-100x REL (0.6 seen, demo)
# dh128: "tiny" at head dim 128, whose prompt chunks take attention_ws.cu's TMA build on an sm_90 GPU
# (tma-attention, on by default; test_tma_attention_is_the_default_on_hopper says it ran)
PACKS = ["demo", "tiny", "odd", "mtp", "kquant", "kquant-mixed", "dh128"]
GGUF_QTYPES = {
    "kquant": {"attn": "Q8_0", "experts": "Q4_K", "embd": "Q6_K", "output": "Q8_0"},
    "kquant-mixed": {"attn": ["Q4_K", "Q8_0"], "experts": ["Q6_K", "Q4_K"], "embd": "Q8_0", "output": "Q6_K"},
}


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            built[name] = _build(name, tmp_path_factory.mktemp(name))
        return built[name]
    return get


def _build(name, tmp):
    if name == "demo":
        return open_pack(demo_model_path())
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.fixtures import SHAPES, make_gguf_pack, make_pack
    if name in GGUF_QTYPES:
        pytest.importorskip("gguf")
        path, _ = make_gguf_pack(tmp, SHAPES["kquant"], GGUF_QTYPES[name], seed=8)
    else:
        path, _ = make_pack(tmp, dict(SHAPES["tiny"], head_dim=128) if name == "dh128" else SHAPES[name], seed=7)
    return open_pack(path)


def test_tma_attention_is_the_default_on_hopper(packs):
    """On an sm_90 GPU with attention_ws.cu's sm_90a library the dh128 pack's prompt chunks take the
    TMA build (the parametrized tests here then check its logits); --kernels-off tma-attention not."""
    import strata.backends.cuda as cuda_backend
    from strata.backends.cuda.kernels import wgmma_unavailable
    rt = cuda_backend._runtime()
    why = wgmma_unavailable(rt.read_manifest(), rt.Device(0).compute_capability, "attention_ws")
    if why:
        pytest.skip(f"attention_ws: {why}")
    pack = packs("dh128")
    assert CudaRunner(pack, 128).ops.tma_attention
    assert not CudaRunner(pack, 128, EngineConfig(kernels_off="tma-attention")).ops.tma_attention


@pytest.mark.parametrize("name", ["demo", "kquant", "kquant-mixed"])
def test_tma_gemm_gives_the_decoding_gemms_logits_bit_for_bit(packs, name, rng, monkeypatch):
    """tma-gemm (on by default on an sm_90 GPU with moe_gemm_ws.cu's sm_90a library): with DQ_MIN_ROWS
    lowered to 1 every prompt GEMM of a block type dequantizes its weights to f16 rows and runs the TMA
    GEMM (strata_moe_gemm_wst_f16), resident and over streamed ring batches in groups of 2 experts; the
    same f16 products, f32 sums in the same order, so the logits of --kernels-off tma-gemm bit for bit."""
    import strata.backends.cuda as cuda_backend
    import strata.backends.cuda.moe as moe
    import strata.backends.cuda.ops_dense as ops_dense
    from strata.backends.cuda.kernels import wgmma_unavailable
    rt = cuda_backend._runtime()
    why = wgmma_unavailable(rt.read_manifest(), rt.Device(0).compute_capability, "moe_gemm_ws")
    if why:
        pytest.skip(f"moe_gemm_ws: {why}")
    for module in (moe, ops_dense):
        monkeypatch.setattr(module, "DQ_MIN_ROWS", 1)
    pack = packs(name)
    a = pack.args
    ids = rng.integers(0, a.vocab_size, 60).tolist()
    cfg = dict(device="cuda", prefill="24")
    off = CudaRunner(pack, 128, EngineConfig(kernels_off="tma-gemm", **cfg))
    on = CudaRunner(pack, 128, EngineConfig(**cfg))
    assert on.ops.gemm_dq and not off.ops.gemm_dq
    want = off.prefill(ids, 0)
    np.testing.assert_array_equal(on.prefill(ids, 0), want)
    per_expert = 2 * 3 * a.moe_intermediate_size * a.hidden_size        # f16 gate|up and down
    monkeypatch.setattr(moe, "DQ_SCRATCH_BYTES", 2 * per_expert)
    monkeypatch.setattr(moe, "DQ_MIN_GROUP", 1)
    streamed = CudaRunner(pack, 128, EngineConfig(expert_cache="0", **cfg))
    np.testing.assert_array_equal(streamed.prefill(ids, 0), want)
    assert streamed.status()["expert_cache"]["prompt_streamed"] > 0


def assert_close(ours, ref, rel=REL):
    bound = rel * np.abs(ref).max()
    assert ours.shape == ref.shape and np.isfinite(ours).all()
    assert np.abs(ours - ref).max() <= bound, f"max err {np.abs(ours - ref).max():.3g} > {bound:.3g}"


@pytest.mark.parametrize("name", PACKS)
def test_logits_match_cpu(packs, name, rng):
    pack = packs(name)
    gpu, cpu = CudaRunner(pack, 128), cpu_runner_f16_kv(pack, 128)
    gpu.prefill_chunk = cpu.prefill_chunk = 16       # chunks of 16, 16 and 5: GEMM and GEMV paths
    ids = oracle_ids(pack, rng, 37, chunk=16, gap=GAP)
    ours = gpu.logits_all(ids)
    assert_close(ours, cpu.logits_all(ids))
    if name == "demo":
        # Against the plain f32-KV engine on real text: on random tokens the f16 cache's rounding can
        # flip a near-tied expert choice (2 of 30 seeds on the CPU alone), which no engine bug causes.
        import inspect
        from strata.tokenizer import Tokenizer
        text_ids = Tokenizer(pack.tokenizer_path, pack.tokenizer_meta).encode(inspect.getsource(CpuRunner))[:37]
        assert_close(gpu.logits_all(text_ids), CpuRunner(pack, 128).logits_all(text_ids), REL_F32_KV)


@pytest.mark.parametrize("name", PACKS)
def test_prefill_equals_shorter_prefill_plus_decode_steps(packs, name, rng):
    pack = packs(name)
    gpu, cpu = CudaRunner(pack, 128), cpu_runner_f16_kv(pack, 128)
    ids = oracle_ids(pack, rng, 30, chunk=30, gap=GAP)
    whole = gpu.prefill(ids, 0)
    gpu.reset()
    step = gpu.prefill(ids[:-5], 0)
    for t in ids[-5:]:
        step = gpu.decode(t)
    assert_close(whole, cpu.prefill(ids, 0))
    # The last 5 tokens through decode steps (f32 GEMVs) against the same steps in the oracle: the
    # prompt path's f16 GEMM inputs differ from the steps' f32 by more than REL (3.1e-3 seen).
    cpu.reset()
    ref = cpu.prefill(ids[:-5], 0)
    for t in ids[-5:]:
        ref = cpu.decode(t)
    assert_close(step, ref)
    assert_close(step, whole, rel=1e-2)


def test_long_prompt_over_chunks_and_decode_splits(packs, rng):
    pack = packs("demo")
    gpu, cpu = CudaRunner(pack, 1024), cpu_runner_f16_kv(pack, 1024)
    ids = rng.integers(0, pack.args.vocab_size, 700).tolist()   # chunks of 512 and 188
    assert_close(gpu.prefill(ids, 0), cpu.prefill(ids, 0))
    for t in ids[:3]:                                             # split-K over ~700 cells
        assert_close(gpu.decode(t), cpu.decode(t))


def test_greedy_32_tokens_identical_to_cpu_on_the_demo_model():
    gpu, cpu = strata.LLM(device="cuda", cuda_graphs=True), strata.LLM(device="cpu")
    for prompt in ("def fibonacci(n):\n    ", "import os\nimport sys\n\n\ndef main():\n"):
        ours, ref = gpu.generate(prompt, max_tokens=32), cpu.generate(prompt, max_tokens=32)
        assert ours.token_ids == ref.token_ids and len(ref.token_ids) > 0
    decode = gpu.status()["decode"]
    steps = {mode: t["steps"] for mode, t in decode["host_ms"].items()}
    assert decode["cuda_graphs"] and steps["eager"] == steps["capture"] == 1 and steps["graph"] >= 1, decode


def test_auto_picks_the_gpu_and_reports_it():
    llm = strata.LLM(device="auto")
    assert llm.device == "cuda"
    llm.generate("x = ", max_tokens=4)
    s = llm.status()
    assert s["device"] == "cuda" and s["gpu"]["dense_bytes"] > 0 and s["expert_cache"]["hits"] > 0
    assert s["gpu"]["vram_used_bytes"] <= s["gpu"]["vram_budget_bytes"]
    assert llm.runner.measure_limits()["device_copy_gb_s"] > 100


def _eager_and_graph(pack, max_context):
    return (CudaRunner(pack, max_context, EngineConfig(device="cuda", cuda_graphs=False)),
            CudaRunner(pack, max_context, EngineConfig(device="cuda", cuda_graphs=True)))


def _decode_both(eager, graph, tokens):
    for t in tokens:
        ours, ref = graph.decode(t), eager.decode(t)
        assert np.array_equal(ours, ref), f"graph != eager: max diff {np.abs(ours - ref).max():.3g}"


def test_graph_decode_equals_eager_bitwise_over_40_steps(packs, rng):
    """40 steps across the length where each split's span grows from one KV tile to two (the split
    count is fixed by the cache size, chosen so it is below the tiles), then, after a reset, short
    steps across tile boundaries where a length-sized split count would have changed. Every row takes
    attention.cu's kernel (tc_from past every length), whose tiles these are: one graph serves them."""
    from strata.backends.cuda.kernels import INT32_MAX
    pack = packs("demo")
    a = pack.args
    probe = CudaRunner(pack, 64)
    tile = 4096 // a.head_dim
    want = probe.ops.decode_splits(a.num_key_value_heads, 1 << 30, a.head_dim)   # splits of a huge cache
    del probe
    eager, graph = _eager_and_graph(pack, (want + 2) * tile)
    eager.ops.tc_from = graph.ops.tc_from = INT32_MAX
    assert graph.ops.decode_splits(a.num_key_value_heads, graph.kv.max_cells, a.head_dim) == want
    boundary = want * tile          # lengths above it give every split two tiles
    ids = rng.integers(0, a.vocab_size, boundary - 20).tolist()
    assert np.array_equal(eager.prefill(ids, 0), graph.prefill(ids, 0))
    _decode_both(eager, graph, rng.integers(0, a.vocab_size, 40).tolist())
    captured = graph.graphs[1]
    assert captured.launches == 39 and not eager.graphs
    for r in (eager, graph):
        r.reset()
    short = rng.integers(0, a.vocab_size, tile - 5).tolist()
    assert np.array_equal(eager.prefill(short, 0), graph.prefill(short, 0))
    _decode_both(eager, graph, rng.integers(0, a.vocab_size, tile + 10).tolist())   # over two tile edges
    assert graph.graphs[1] is captured and captured.launches == 39 + tile + 10


def test_graph_decode_equals_eager_bitwise_across_the_tensor_core_threshold(packs, rng):
    """Steps whose rows cross tc_from (the tensor cores' f16 decode kernel from there on, attention.cu's
    below): eager and graph logits equal bit for bit, the graph of each rule captured once."""
    pack = packs("demo")
    eager, graph = _eager_and_graph(pack, 128)
    eager.ops.tc_from = graph.ops.tc_from = 40
    ids = rng.integers(0, pack.args.vocab_size, 30).tolist()
    assert np.array_equal(eager.prefill(ids, 0), graph.prefill(ids, 0))
    _decode_both(eager, graph, rng.integers(0, pack.args.vocab_size, 20).tolist())    # lengths 31..50
    assert graph.graphs[1].launches == 8 and graph.graphs["1+tc"].launches == 10     # n steps: eager, then n - 1


@pytest.mark.parametrize("name", ["kquant-mixed", "mtp"])
def test_graph_decode_equals_eager_bitwise_other_packs(packs, name, rng):
    pack = packs(name)
    eager, graph = _eager_and_graph(pack, 128)
    ids = rng.integers(0, pack.args.vocab_size, 21).tolist()
    assert np.array_equal(eager.prefill(ids, 0), graph.prefill(ids, 0))
    _decode_both(eager, graph, rng.integers(0, pack.args.vocab_size, 12).tolist())
    assert graph.graphs[1].launches == 11


def test_prefix_reuse_after_a_graph_was_captured(packs, rng):
    pack = packs("demo")
    eager, graph = _eager_and_graph(pack, 256)
    cpu = cpu_runner_f16_kv(pack, 256)
    V = pack.args.vocab_size
    first = rng.integers(0, V, 40).tolist()
    for r in (eager, graph):
        r.prefill(first, 0)
    steps = rng.integers(0, V, 6).tolist()
    _decode_both(eager, graph, steps)
    captured = graph.graphs[1]
    turn = rng.integers(0, V, 30).tolist()
    turn[0] = (steps[4] + 1) % V                                           # differs right after the 44 reused
    follow_up = first + steps[:4] + turn
    assert graph.reusable_prefix(follow_up) == eager.reusable_prefix(follow_up) == 44
    ours = graph.prefill(follow_up, 44)
    assert np.array_equal(ours, eager.prefill(follow_up, 44))
    assert_close(ours, cpu.prefill(follow_up, 0))
    for t in rng.integers(0, V, 8).tolist():
        ours = graph.decode(t)
        assert np.array_equal(ours, eager.decode(t))
        assert_close(ours, cpu.decode(t))
    assert graph.graphs[1] is captured and captured.launches == 5 + 8


@pytest.mark.parametrize("cache", ["0", "20"])
def test_streamed_experts_give_the_resident_logits_bit_for_bit(packs, rng, cache):
    """Experts in pinned host memory (read zero-copy by decode, streamed through the prompt ring)
    and a small VRAM cache: the same kernels on the same bytes as the resident run."""
    pack = packs("demo")
    cfg = dict(device="cuda", prefill="24")
    resident = CudaRunner(pack, 128, EngineConfig(**cfg))
    streamed = CudaRunner(pack, 128, EngineConfig(expert_cache=cache, **cfg))
    assert resident.store.resident and not streamed.store.resident
    ids = rng.integers(0, pack.args.vocab_size, 70).tolist()
    np.testing.assert_array_equal(streamed.prefill(ids[:60], 0), resident.prefill(ids[:60], 0))
    for t in ids[60:]:
        np.testing.assert_array_equal(streamed.decode(t), resident.decode(t))
    s = streamed.status()["expert_cache"]
    assert s["misses"] > 0 and s["prompt_streamed"] > 0 and streamed.decode_status()["host_ms"]["graph"]["steps"] >= 7


def test_partly_pinned_arena_gives_the_resident_logits_bit_for_bit(packs, rng):
    """--pin-limit-gib pins a prefix of whole layers; the rest goes through the staging ring (helper
    threads, pinned buffers, events) and decode misses of it are staged: the same bytes, the same logits."""
    pack = packs("demo")
    half = int(pack.meta["files"]["experts.bin"]["bytes"]) / 2 / 2**30
    resident = CudaRunner(pack, 128, EngineConfig(device="cuda", prefill="24"))
    partial = CudaRunner(pack, 128, EngineConfig(device="cuda", prefill="24", expert_cache="20", pin_limit_gib=half))
    share = partial.status()["expert_cache"]["arena_pinned_share"]
    assert 0 < share < 1 and not partial.use_graphs
    ids = rng.integers(0, pack.args.vocab_size, 70).tolist()
    np.testing.assert_array_equal(partial.prefill(ids[:60], 0), resident.prefill(ids[:60], 0))
    for t in ids[60:]:
        np.testing.assert_array_equal(partial.decode(t), resident.decode(t))


def test_device_pick_equals_the_host_pick(packs, rng):
    """runner.pick on the GPU (cuda/argmax.cu greedy, cuda/sample.cu otherwise) against
    strata.engine.sampler.pick_host on the same logits and draws, after a prompt and after decode
    steps; only a draw within 1e-5 of a boundary may differ (f32 exp and integer masses there)."""
    from strata.backends.cuda.sample import sample_reference
    from strata.config import SamplingParams
    from strata.engine.sampler import pick_host
    pack = packs("demo")
    runner = CudaRunner(pack, 96, EngineConfig(device="cuda", cuda_graphs=True))
    ids = rng.integers(0, pack.args.vocab_size, 40).tolist()
    params = [SamplingParams(), SamplingParams(temperature=0.7, top_k=40, top_p=0.9),
              SamplingParams(temperature=1.3, top_p=0.5), SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=0.9)]
    compared = 0
    steps = [lambda: runner.prefill(ids, 0)] + [lambda t=t: runner.decode(t) for t in ids[:4]]   # eager, capture, graph
    for step in steps:
        logits = step()
        for p in params:
            for u in rng.random(4):
                margin = sample_reference(logits[None], p.temperature, p.top_k, p.top_p, u, margins=True)[2][0]
                if margin > 1e-5:
                    assert runner.pick(p, u) == pick_host(logits, p, u), (p, u)
                    compared += 1
    assert compared >= 0.8 * len(steps) * len(params) * 4


def test_seeded_generation_is_reproducible_on_the_device():
    llm = strata.LLM(device="cuda")
    a = llm.generate("def add(a, b):", max_tokens=24, temperature=0.8, top_p=0.95, top_k=50, seed=11)
    b = llm.generate("def add(a, b):", max_tokens=24, temperature=0.8, top_p=0.95, top_k=50, seed=11)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0


def test_programmatic_dependent_launches_change_no_bit(packs, rng):
    """PDL (cuda/pdl.cuh) only lets a kernel be scheduled early; it waits for the previous grid
    before anything else, so graph decode with and without it must agree bitwise."""
    pack = packs("kquant-mixed")
    on, off = (CudaRunner(pack, 64, EngineConfig(device="cuda", cuda_graphs=True)) for _ in range(2))
    off.ops.pdl = False
    if not on.ops.pdl:
        pytest.skip("programmatic dependent launches need sm_90 or later")
    ids = rng.integers(0, pack.args.vocab_size, 20).tolist()
    assert np.array_equal(on.prefill(ids[:12], 0), off.prefill(ids[:12], 0))
    for t in ids[12:]:
        assert np.array_equal(on.decode(t), off.decode(t))


@pytest.mark.parametrize("name", ["demo", "kquant"])
def test_one_row_gemv_changes_no_bit(packs, name, rng):
    """one-row-gemv (on by default): the one-token GEMVs one row a warp (strata_gemv_one_*, strata_gemv3_one_*)
    sum each row as the 4-row kernels do (--kernels-off one-row-gemv), so graph decode agrees bitwise."""
    pack = packs(name)
    on, off = (CudaRunner(pack, 64, EngineConfig(device="cuda", cuda_graphs=True, kernels_off=k))
               for k in ("", "one-row-gemv"))
    assert on.ops.paths.one_row_gemv and not off.ops.paths.one_row_gemv
    ids = rng.integers(0, pack.args.vocab_size, 24).tolist()
    assert np.array_equal(on.prefill(ids[:12], 0), off.prefill(ids[:12], 0))
    for t in ids[12:]:
        assert np.array_equal(on.decode(t), off.decode(t))


@pytest.mark.parametrize("name", ["demo", "kquant"])
def test_cluster_decode_graphs_and_eager_agree_and_stay_near_split_k(packs, name, rng):
    """cluster-decode (on trial, sm_90+): a short row's decode attention in one cluster launch (16 splits and their
    combine) is split-K over 16 splits, not over the cache's splits, so its logits are near the default path's,
    not equal; eager and graph decode with it agree bit for bit (the graph's key says 1+cl), and so does a
    prompt's logits (the prompt path does not take it)."""
    from strata.errors import UnsupportedError
    pack = packs(name)
    try:
        on = CudaRunner(pack, 64, EngineConfig(device="cuda", cuda_graphs=True, kernels_on="cluster-decode"))
    except UnsupportedError as e:
        pytest.skip(str(e))
    eager, off = (CudaRunner(pack, 64, EngineConfig(device="cuda", cuda_graphs=g, kernels_on=k))
                  for g, k in ((False, "cluster-decode"), (True, "")))
    ids = rng.integers(0, pack.args.vocab_size, 24).tolist()
    first = [r.prefill(ids[:12], 0) for r in (on, eager, off)]
    assert np.array_equal(first[0], first[2]) and np.array_equal(first[0], first[1])
    for t in ids[12:]:
        a, b, c = on.decode(t), eager.decode(t), off.decode(t)
        assert np.array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-4 * float(np.abs(c).max()))
    assert "1+cl" in on.graphs, sorted(map(str, on.graphs))


@pytest.mark.parametrize("name", ["demo", "kquant", "kquant-mixed"])
def test_route_in_moe_and_norm_in_router_change_no_bit(packs, name, rng):
    """route-in-moe and norm-in-router (on by default), each and both: each decode step's top-k made in the MoE
    gate|up kernel's blocks (cuda/route.cuh's code, as strata_moe_route_f32), the post-attention add + RMSNorm in
    the router's blocks (strata_add_rms_norm_f32's sum order), give graph decode's logits bit for bit against
    --kernels-off of both, one slot and a batched step of two; and the same under a VRAM budget (the route
    log copied after gate|up)."""
    pack = packs(name)
    ids = rng.integers(0, pack.args.vocab_size, 24).tolist()
    paths = "route-in-moe,norm-in-router"
    for on_off in ("norm-in-router", "route-in-moe", ""):       # each on, then both
        for extra in ({}, {"expert_cache": "9", "prefill": "24"}):
            on, off = (CudaRunner(pack, 64, EngineConfig(device="cuda", cuda_graphs=True, kernels_off=k, **extra))
                       for k in (on_off, paths))
            assert np.array_equal(on.prefill(ids[:12], 0), off.prefill(ids[:12], 0))
            for t in ids[12:]:
                assert np.array_equal(on.decode(t), off.decode(t)), (on_off, extra)
    on, off = (CudaRunner(pack, 48, EngineConfig(device="cuda", cuda_graphs=True, parallel=2, kernels_off=k))
               for k in ("", paths))
    for r in (on, off):
        for slot in range(2):
            r.use(slot)
            r.prefill(ids[:6 + slot], 0, logits=False)
    got, want = (r.ops.to_host(r.batch_rows([0, 1], ids[10:12], [6, 7])) for r in (on, off))
    assert np.array_equal(got, want)


@pytest.mark.parametrize("name", ["demo", "kquant"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_pick_and_step_equals_pick_then_decode(packs, name, sampled, rng):
    """pick(step=True) on the GPU: each step queued behind its pick, its id copied on the device,
    leaves the same tokens, cells and next logits as pick() then decode() (bit for bit)."""
    from strata.config import SamplingParams
    from tests.engine.test_pick_ahead_host import _run
    pack = packs(name)
    runner = CudaRunner(pack, 96)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9) if sampled else SamplingParams()
    prompt = rng.integers(0, pack.args.vocab_size, 9).tolist()
    draws = rng.random(16).tolist()
    plain, plain_logits = _run(runner, prompt, params, 16, False, draws)
    ahead, ahead_logits = _run(runner, prompt, params, 16, True, draws)
    assert runner.steps_ahead == 16
    assert ahead == plain and runner.cached_ids == prompt + plain
    np.testing.assert_array_equal(ahead_logits, plain_logits)
