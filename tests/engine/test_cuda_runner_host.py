"""The GPU engine's host logic, on the CPU: CudaRunner over tests/engine/fake_cuda, whose kernels are
numpy emulations of their contracts. Addresses, strides, grouping and launch arguments are checked
here; the kernels themselves in tests/kernels and the whole path in test_cuda_runner.py, on a GPU."""
import dataclasses
import functools

import numpy as np
import pytest

import strata.backends.cuda as cuda_backend
from strata.backends.cuda.memory import Pool, gemv_grid, gemv_whole_grid
from strata.backends.cuda.moe import group_by_expert
from strata.engine import llm as llm_module
from strata.config import EngineConfig
from strata.engine.cuda_decode import DecodeSteps
from strata.engine.cuda_runner import CudaRunner
from strata.engine.llm import demo_model_path
from strata.errors import DeviceError, InvalidArgument, UnsupportedError
from strata.pack import open_pack
from tests.engine.cpu_f16_kv import cpu_runner_f16_kv, oracle_ids

DEMO = demo_model_path()


def assert_close(ours, ref, rel=1e-3):
    """Against the numpy engine at the GPU's declared precision (f16 K/V, f16 inputs of the tensor-core
    prompt GEMMs: tests/engine/cpu_f16_kv.py), the bound of test_cuda_runner.py: what is left is
    summation order and the f16 roundings it flips, up to 4.5e-4 measured here over 8 seeds."""
    bound = rel * np.abs(ref).max()
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= bound, f"max err {np.abs(ours - ref).max():.3g} > {bound:.3g}"


def test_emulated_runner_matches_cpu_on_the_demo_model(fake, rng):
    pack = open_pack(DEMO)
    gpu, cpu = CudaRunner(pack, 64), cpu_runner_f16_kv(pack, 64)
    gpu.prefill_chunk = cpu.prefill_chunk = 12          # a grouped-MoE chunk of 12, then a GEMV chunk of 8
    ids = oracle_ids(pack, rng, 20, chunk=12)
    assert_close(gpu.logits_all(ids), cpu.logits_all(ids))
    assert_close(gpu.prefill(ids[:15], 0), cpu.prefill(ids[:15], 0))
    for t in ids[15:18]:
        assert_close(gpu.decode(t), cpu.decode(t))
    used = set(fake.launches)
    assert {"strata_moe_gate_up_route_q8_0", "strata_moe_down_q8_0", "strata_gemm_f32_nt",
            "strata_attention_decode_f16_d64_g2", "strata_attention_prefill_tc_f16_d64", "strata_moe_group"} <= used
    pdl = set(fake.pdl_launches)       # the decode path's libraries only (cuda/pdl.cuh)
    assert {"strata_gemv3_one_q8_0", "strata_moe_gate_up_route_q8_0", "strata_add_rms_norm_f32",
            "strata_add_norm_router_f32"} <= pdl
    assert not pdl & {"strata_moe_gemm_q8_0", "strata_moe_group", "strata_attention_prefill_tc_f16_d64"}


def test_tc_attention_off_takes_the_cuda_core_prompt_kernel(fake, rng):
    """--kernels-off tc-attention (the A/B of cuda/attention_tc.cu): prompts attend through
    attention.cu's kernel instead, to the same precision."""
    pack = open_pack(DEMO)
    gpu = CudaRunner(pack, 64, EngineConfig(kernels_off="tc-attention"))
    cpu = cpu_runner_f16_kv(pack, 64)
    ids = oracle_ids(pack, rng, 20)
    assert_close(gpu.prefill(ids, 0), cpu.prefill(ids, 0))
    assert "strata_attention_prefill_f16_d64" in fake.launches
    assert "strata_attention_prefill_tc_f16_d64" not in fake.launches


# trial path(s) -> (entry points it launches, entry points it replaces: never launched), the library it needs
WGMMA_TRIALS = [
    ("wgmma-gemm", {"strata_moe_gemm_ws_q8_0"}, "strata_moe_gemm_q", "moe_gemm_ws"),
    ("wgmma-gemm-f16x", {"strata_moe_gemm_ws16_q8_0", "strata_gather_rows_f16", "strata_swiglu_rows_f16"},
     "strata_moe_gemm_q", "moe_gemm_ws"),
    ("wgmma-attention", {"strata_attention_prefill_wg_f16_d64"}, "strata_attention_prefill_tc_", "attention_wg"),
    ("wgmma-attention, wgmma-gemm", {"strata_attention_prefill_wg_f16_d64", "strata_moe_gemm_ws_q8_0"},
     "strata_attention_prefill_tc_", "attention_wg"),
]


@pytest.mark.parametrize("on,launched,replaced,library", WGMMA_TRIALS)
def test_wgmma_trial_paths_take_their_kernels(fake, rng, monkeypatch, on, launched, replaced, library):
    """--kernels-on wgmma-gemm / wgmma-attention: the prompt GEMMs launch cuda/moe_gemm_ws.cu's entry
    points (wgmma-gemm-f16x: its f16-X ones, X gathered and SwiGLU's output written as f16: the same
    products, as the GEMMs round X to f16 anyway), prompt attention at Dh 64 cuda/attention_wg.cu's (each
    the contract of the kernel it replaces, so the same logits here); refused in one line where the
    install has no such library."""
    pack = open_pack(DEMO)
    ids = oracle_ids(pack, rng, 20)
    base = CudaRunner(pack, 64).prefill(ids, 0)
    fake.launches.clear()
    wg = CudaRunner(pack, 64, EngineConfig(kernels_on=on))
    np.testing.assert_array_equal(wg.prefill(ids, 0), base)
    assert launched <= set(fake.launches)
    assert not [n for n in fake.launches if n.startswith(replaced)]
    kept = {lib: e for lib, e in fake.read_manifest()["kernels"].items() if lib != library}
    monkeypatch.setattr(fake, "read_manifest", lambda directory=None: {"format": 1, "kernels": kept})
    with pytest.raises(UnsupportedError, match=r"kernel path wgmma-[\w-]+ \(--kernels-on\): this install has no "
                                               + library):
        CudaRunner(pack, 64, EngineConfig(kernels_on=on))


def test_tma_gemm_dequantizes_first_and_gives_the_same_logits(fake, rng, monkeypatch):
    """tma-gemm (on by default where the sm_90a library runs): where a chunk has DQ_MIN_ROWS rows an expert
    (lowered here for the demo model's 20 tokens), every expert of a layer is dequantized to f16 rows in one
    launch a matrix and the f16 GEMMs run over them with both operands moved by the TMA (moe_gemm_wst_f16,
    its tensor maps over the scratch and X: the emulation reads through them), the dense projections
    likewise: the same f16 operands as the decoding GEMMs', so the same logits as --kernels-off tma-gemm.
    Under the threshold, with no room for the scratch, or without the library: the mma.sync GEMMs over f32
    X, as with the path off."""
    import strata.backends.cuda.moe as moe
    import strata.backends.cuda.ops_dense as ops_dense
    pack = open_pack(DEMO)
    ids = oracle_ids(pack, rng, 20)
    fake.launches.clear()
    base = CudaRunner(pack, 64, EngineConfig(kernels_off="tma-gemm")).prefill(ids, 0)
    decoding = {n for n in fake.launches if n.startswith("strata_moe_gemm_q")}
    assert decoding and not [n for n in fake.launches if n.startswith(("strata_dequant_h", "strata_moe_gemm_w"))]

    def launches_of(paths: dict | None = None) -> set:
        fake.launches.clear()
        np.testing.assert_array_equal(CudaRunner(pack, 64, EngineConfig(**(paths or {}))).prefill(ids, 0), base)
        return set(fake.launches)
    runner = CudaRunner(pack, 64)     # its kernels looked up at load: the first long prompt pays no library load
    assert ("moe_gemm_wst",) in runner.ops._launches and ("dequant_h_groups", ("qtype", "Q8_0")) in runner.ops._launches
    assert not [k for k in CudaRunner(pack, 64, EngineConfig(kernels_off="tma-gemm")).ops._launches
                if k[0] in ("moe_gemm_wst", "dequant_h_groups")]
    under = launches_of()
    assert decoding <= under and not [n for n in under if n.startswith(("strata_dequant_h", "strata_moe_gemm_w"))]
    for module in (moe, ops_dense):
        monkeypatch.setattr(module, "DQ_MIN_ROWS", 1)
    over = launches_of()
    assert {"strata_dequant_h_groups_q8_0", "strata_dequant_h_q8_0", "strata_moe_gemm_wst_f16",
            "strata_gather_rows_f16", "strata_swiglu_rows_f16"} <= over
    assert not [n for n in over if n.startswith("strata_moe_gemm_ws16")]
    assert not (decoding & over)        # every GEMM of the chunk's block types on the f16 path
    # no room for the f16 weights (try_alloc's None, as a full card or a frozen pool gives): the decoding GEMMs
    import strata.backends.cuda.ops as ops_module
    with monkeypatch.context() as m:
        m.setattr(ops_module.DeviceOps, "try_alloc", lambda self, shape, dtype=np.float32: None)
        full = launches_of()
    assert decoding <= full and not [n for n in full if n.startswith(("strata_dequant_h", "strata_moe_gemm_w"))]
    # an install without moe_gemm_ws's sm_90a library: quietly the decoding GEMMs (a default path, not refused)
    kept = {lib: e for lib, e in fake.read_manifest()["kernels"].items() if lib != "moe_gemm_ws"}
    monkeypatch.setattr(fake, "read_manifest", lambda directory=None: {"format": 1, "kernels": kept})
    assert decoding <= launches_of() and "strata_moe_gemm_wst_f16" not in fake.launches


def test_try_alloc_gives_none_where_the_pool_cannot_grow(fake):
    """DeviceOps.try_alloc: a block where there is room, None (not an error) where a frozen pool has none."""
    from strata.backends.cuda.memory import Pool
    runner = CudaRunner(open_pack(DEMO), 64)
    ops = runner.ops
    ops.pool = Pool(ops.rt, ops.device, reserve_bytes=1 << 20)
    assert ops.try_alloc((1024,), np.float16) is not None
    assert ops.try_alloc((1 << 20,), np.float32) is None


def test_f16x_gemms_with_the_routing_grouped_on_the_host(fake, rng):
    """wgmma-gemm-f16x where the host groups a chunk's rows (--kernels-off group-on-device): the expert
    rows gathered and SwiGLU's rows written as f16 there too, and the same logits."""
    pack = open_pack(DEMO)
    ids = oracle_ids(pack, rng, 20)
    base = CudaRunner(pack, 64, EngineConfig(kernels_off="group-on-device")).prefill(ids, 0)
    fake.launches.clear()
    runner = CudaRunner(pack, 64, EngineConfig(kernels_on="wgmma-gemm-f16x", kernels_off="group-on-device"))
    np.testing.assert_array_equal(runner.prefill(ids, 0), base)
    assert {"strata_swiglu_f16", "strata_gather_rows_f16", "strata_moe_gemm_ws16_q8_0"} <= set(fake.launches)
    assert "strata_swiglu_f32" not in fake.launches and "strata_moe_gemm_ws_q8_0" not in fake.launches


def _prefill_then_decode(fake, pack, ids, config, **ops_fields):
    """A 12-token prompt, then the rest of ids decoded one by one, on a runner whose ops take ops_fields
    (tc_from=, cluster_below=: the f16 decode kernels' cuts) -> (each call's logits, the runner); the fake's
    launches are this run's."""
    fake.launches.clear()
    runner = CudaRunner(pack, 64, config)
    for name, value in ops_fields.items():
        setattr(runner.ops, name, value)
    return [runner.prefill(ids[:12], 0)] + [runner.decode(t) for t in ids[12:]], runner


@pytest.mark.parametrize("graphs", [False, True])
def test_tc_decode_attention_takes_rows_by_their_length(fake, rng, graphs):
    """tc-decode-attention (on by default): decode rows of ops.tc_from cells or more attend over the f16
    cache through cuda/attention_dec_tc.cu's kernel, shorter ones through attention.cu's (the same
    contract, so the same logits here), eager and in captured graphs, whose keys name the kernels
    they hold; --kernels-off tc-decode-attention leaves every row to attention.cu's."""
    pack = open_pack(DEMO)
    ids = oracle_ids(pack, rng, 24)
    tc_name = "strata_attention_decode_tc_f16_d64_g2"
    run = functools.partial(_prefill_then_decode, fake, pack, ids)
    base, off = run(EngineConfig(cuda_graphs=graphs, kernels_off="tc-decode-attention"), tc_from=0)
    assert tc_name not in fake.launches and set(off.graphs) <= {1}
    short, _ = run(EngineConfig(cuda_graphs=graphs))        # the demo's 64 cells: every row under TC_DECODE_FROM
    assert tc_name not in fake.launches
    by_length, runner = run(EngineConfig(cuda_graphs=graphs), tc_from=18)   # steps of 13..24 cells
    for a, b, c in zip(base, short, by_length):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    assert tc_name in fake.launches and tc_name in set(fake.pdl_launches)
    assert "strata_attention_decode_f16_d64_g2" in fake.launches
    if graphs:
        assert {1, "1+tc"} <= set(runner.graphs)
    assert runner.ops.decode_lengths is None                 # the step's lengths do not outlive it


def _path_ab(fake, pack, ids, graphs: bool, off: str) -> tuple[list, list]:
    """Decode steps with the default paths and with `off` turned off: their logits equal bit for bit ->
    (the kernels the default steps launched, those the steps without the paths launched)."""
    on, launched = _decode_launches(fake, pack, ids, EngineConfig(cuda_graphs=graphs))
    plain, launched_off = _decode_launches(fake, pack, ids, EngineConfig(cuda_graphs=graphs, kernels_off=off))
    for a, b in zip(on, plain):
        np.testing.assert_array_equal(a, b)
    return launched, launched_off


def _decode_launches(fake, pack, ids, config):
    """The logits of a prefill of ids[:10] and decode steps of the rest, and the kernels the steps launched."""
    runner = CudaRunner(pack, 64, config)
    out = [runner.prefill(ids[:10], 0)]
    fake.launches.clear()
    out += [runner.decode(t) for t in ids[10:]]
    return out, list(fake.launches)


@pytest.mark.parametrize("graphs", [False, True])
def test_decode_routers_route_in_their_last_block(fake, rng, graphs):
    """--kernels-on fused-route: a decode step's F32 router GEMV routes in its last block
    (strata_router_split_f32; a batched step's strata_router_rows_split_f32), moe_route is not
    launched, and the logits are the default path's bit for bit (the same GEMV sums and route code);
    prompts keep linear + moe_route."""
    pack = open_pack(DEMO)
    ids = oracle_ids(pack, rng, 16)
    fused, launched = _decode_launches(fake, pack, ids, EngineConfig(cuda_graphs=graphs, kernels_on="fused-route"))
    plain, launched_off = _decode_launches(fake, pack, ids, EngineConfig(cuda_graphs=graphs, kernels_off=OFF))
    for a, b in zip(fused, plain):
        np.testing.assert_array_equal(a, b)
    assert "strata_router_split_f32" in launched and "strata_moe_route_f32" not in launched
    assert "strata_moe_route_f32" in launched_off and "strata_router_split_f32" not in launched_off

    par = CudaRunner(pack, 48, EngineConfig(cuda_graphs=graphs, parallel=2, kernels_on="fused-route"))
    for slot in range(2):
        par.use(slot)
        par.prefill(ids[:6 + slot], 0, logits=False)
    fake.launches.clear()
    par.decode_batch([0, 1], ids[10:12])
    assert "strata_router_rows_split_f32" in fake.launches and "strata_moe_route_f32" not in fake.launches


OFF = "route-in-moe,norm-in-router"      # the launches apart: moe_route, add_rms_norm, the router GEMV


@pytest.mark.parametrize("graphs", [False, True])
def test_decode_steps_route_in_the_gate_up_kernel(fake, rng, graphs):
    """route-in-moe (on by default): a decode step's routing runs in the MoE gate|up kernel's blocks
    (strata_moe_gate_up_route_*, writing the ids and weights down reads), moe_route is not launched, and
    the logits are --kernels-off route-in-moe's bit for bit (the same route code); a batched step of parallel
    slots likewise; prompts keep linear + moe_route + the grouped GEMMs."""
    pack = open_pack(DEMO)
    ids = oracle_ids(pack, rng, 16)
    launched, launched_off = _path_ab(fake, pack, ids, graphs, "route-in-moe")
    fused = [n for n in launched if n.startswith("strata_moe_gate_up_route_")]
    assert fused and "strata_moe_route_f32" not in launched and "strata_moe_route_f32" in launched_off
    assert not [n for n in launched_off if n.startswith("strata_moe_gate_up_route_")]

    fake.launches.clear()
    CudaRunner(pack, 64).prefill(ids[:10], 0)
    assert "strata_moe_route_f32" in fake.launches       # a prompt chunk routes on its own

    par = CudaRunner(pack, 48, EngineConfig(cuda_graphs=graphs, parallel=2))
    for slot in range(2):
        par.use(slot)
        par.prefill(ids[:6 + slot], 0, logits=False)
    fake.launches.clear()
    par.decode_batch([0, 1], ids[10:12])
    assert set(fused) <= set(fake.launches) and "strata_moe_route_f32" not in fake.launches


def test_route_in_moe_under_a_budget_logs_the_routing_it_makes(fake, rng):
    """Under a VRAM budget a decode step's routing goes back to the host (the plan's route log, which the
    expert cache learns from): with route-in-moe the ids come from the gate|up kernel, so the log is copied
    after it; the steps' logits and the cache's view of the routing equal --kernels-off route-in-moe's."""
    pack = open_pack(DEMO)
    ids = oracle_ids(pack, rng, 14)

    def run(config):
        runner = CudaRunner(pack, 64, config)
        out = [runner.prefill(ids[:8], 0)]
        fake.launches.clear()
        out += [runner.decode(t) for t in ids[8:]]
        return out, list(fake.launches), runner
    budget = dict(device="cuda", prefill="24", expert_cache="9")
    routed, launched, runner = run(EngineConfig(**budget))
    plain, _, plain_runner = run(EngineConfig(kernels_off="route-in-moe", **budget))
    assert not runner.store.resident and runner.store.stats.decode_misses > 0
    assert runner.store.stats.decode_misses == plain_runner.store.stats.decode_misses
    assert [n for n in launched if n.startswith("strata_moe_gate_up_route_")] and "strata_moe_route_f32" not in launched
    for a, b in zip(routed, plain):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(runner.steps._route_host, plain_runner.steps._route_host)


@pytest.mark.parametrize("graphs", [False, True])
def test_norm_in_router_makes_the_norm_in_the_routers_blocks(fake, rng, graphs):
    """norm-in-router (on by default): a decode step's post-attention add + RMSNorm runs in the F32 router GEMV's
    blocks (strata_add_norm_router_f32), so a layer launches strata_add_rms_norm_f32 once (the norm before
    attention) instead of twice and no separate router GEMV; the logits are --kernels-off's bit for bit, with
    and without route-in-moe, in a batched step of parallel slots, and under a budget. Prompts keep the
    launches apart; --kernels-on fused-route turns both paths off (its router routes)."""
    pack = open_pack(DEMO)
    layers = pack.args.num_hidden_layers
    ids = oracle_ids(pack, rng, 16)
    plain, launched_off = _decode_launches(fake, pack, ids, EngineConfig(cuda_graphs=graphs, kernels_off=OFF))
    for off in ("route-in-moe", ""):
        fused, launched = _decode_launches(fake, pack, ids, EngineConfig(cuda_graphs=graphs, kernels_off=off))
        for a, b in zip(fused, plain):
            np.testing.assert_array_equal(a, b)
        fused_norms = launched.count("strata_add_norm_router_f32")      # steps run eagerly or captured, x layers
        assert fused_norms and fused_norms % layers == 0
        assert launched.count("strata_add_rms_norm_f32") == launched_off.count("strata_add_rms_norm_f32") - fused_norms
        assert "strata_gemv_split_f32" not in launched and "strata_gemv_split_f32" in launched_off

    fake.launches.clear()
    CudaRunner(pack, 64).prefill(ids[:10], 0)
    assert "strata_add_norm_router_f32" not in fake.launches
    _, launched = _decode_launches(fake, pack, ids, EngineConfig(cuda_graphs=graphs, kernels_on="fused-route"))
    assert "strata_router_split_f32" in launched and not [n for n in launched if "add_norm_router" in n or "route_" in n]

    for extra in ({"parallel": 2}, {"device": "cuda", "prefill": "24", "expert_cache": "9"}):
        runs = []
        for off in ("", OFF):
            fake.launches.clear()
            r = CudaRunner(pack, 48, EngineConfig(cuda_graphs=graphs, kernels_off=off, **extra))
            if "parallel" in extra:
                for slot in range(2):
                    r.use(slot)
                    r.prefill(ids[:6 + slot], 0, logits=False)
                runs.append(r.ops.to_host(r.batch_rows([0, 1], ids[10:12], [6, 7])))
            else:
                runs.append([r.prefill(ids[:8], 0)] + [r.decode(t) for t in ids[8:12]])
            assert ("strata_add_norm_router_f32" in fake.launches) == (not off)
        np.testing.assert_array_equal(np.asarray(runs[0]), np.asarray(runs[1]))


def test_fused_decode_paths_stay_off_where_the_model_cannot_take_them(fake, rng, monkeypatch):
    """route-in-moe and norm-in-router are quietly off where their kernels do not apply: rows past the
    router kernel's shared memory keep the norm apart, and without the fused MoE kernels (--kernels-off
    fused-decode: the GEMV path) the top-k keeps its own launch; the logits are the paths-off ones."""
    from strata.backends.cuda import ops_dense
    pack = open_pack(DEMO)
    ids = oracle_ids(pack, rng, 14)
    monkeypatch.setattr(ops_dense, "NORM_ROUTER_SHARED_BYTES", 16)          # no row fits
    quiet, launched = _decode_launches(fake, pack, ids, EngineConfig(kernels_off="fused-decode"))
    plain, _ = _decode_launches(fake, pack, ids, EngineConfig(kernels_off=OFF + ",fused-decode"))
    for a, b in zip(quiet, plain):
        np.testing.assert_array_equal(a, b)
    assert "strata_moe_route_f32" in launched and "strata_add_norm_router_f32" not in launched


@pytest.mark.parametrize("graphs", [False, True])
def test_one_row_gemv_takes_its_kernels_and_keeps_the_batches_on_its_sum_order(fake, rng, graphs):
    """one-row-gemv (on by default): a decode step's q|k|v and its attention output (Q8_0, too few row
    sets to fill the GPU) run one row a warp (strata_gemv3_one_*, strata_gemv_one_*), the head (many
    row sets) keeps strata_gemv_*; the attention output, no longer short of blocks at one row a warp,
    leaves the split-K kernel at every batch size, so a batched step's rows take strata_gemv_rows_*
    (the unsplit sum order, batch 1's bits on the device). The logits are --kernels-off one-row-gemv's."""
    pack = open_pack(DEMO)
    ids = oracle_ids(pack, rng, 14)
    launched, launched_off = _path_ab(fake, pack, ids, graphs, "one-row-gemv")
    assert {"strata_gemv3_one_q8_0", "strata_gemv_one_q8_0", "strata_gemv_q8_0"} <= set(launched)
    assert "strata_gemv_split_q8_0" not in launched and "strata_gemv3_q8_0" not in launched
    assert "strata_gemv_split_q8_0" in launched_off and not any("_one_" in k for k in launched_off)

    for config, batched in ((EngineConfig(cuda_graphs=graphs, parallel=2), "strata_gemv_rows_q8_0"),
                            (EngineConfig(cuda_graphs=graphs, parallel=2, kernels_off="one-row-gemv"),
                             "strata_gemv_rows_split_q8_0")):
        par = CudaRunner(pack, 48, config)
        for slot in range(2):
            par.use(slot)
            par.prefill(ids[:6 + slot], 0, logits=False)
        fake.launches.clear()
        par.decode_batch([0, 1], ids[10:12])
        assert batched in fake.launches


def test_a_few_prompt_rows_take_the_kernels_their_longest_names(fake, rng):
    """A prompt of up to 8 tokens attends through the split-K decode kernels: the tensor cores' one
    launches only where its longest row reaches tc_from (Positions.num_cells), the logits the same."""
    pack = open_pack(DEMO)
    ids = oracle_ids(pack, rng, 5)
    outs = []
    for tc_from, tc in ((100, False), (3, True)):
        fake.launches.clear()
        runner = CudaRunner(pack, 64, EngineConfig())
        runner.ops.tc_from = tc_from
        outs.append(runner.prefill(ids, 0))
        assert ("strata_attention_decode_tc_f16_d64_g2" in fake.launches) is tc
        assert "strata_attention_decode_f16_d64_g2" in fake.launches        # rows of 1 and 2 cells
    np.testing.assert_array_equal(*outs)


def test_decode_rule_names_the_kernels_of_a_step(fake):
    pack = open_pack(DEMO)
    ops = CudaRunner(pack, 64, EngineConfig()).ops
    ops.tc_from = 100
    assert (ops.decode_rule(1, 99), ops.decode_rule(100, 107), ops.decode_rule(97, 104)) == ("", "+tc", "+both")
    ops.paths = dataclasses.replace(ops.paths, tc_decode_attention=False)
    assert ops.decode_rule(100, 107) == ""
    # cluster-decode (on trial): rows under cluster_below take the cluster kernel, named first
    ops.paths = dataclasses.replace(ops.paths, tc_decode_attention=True, cluster_decode=True)
    ops.cluster_below = 20
    assert [ops.decode_rule(*r) for r in ((1, 19), (1, 99), (1, 104), (20, 99), (100, 107), (5, 20))] == \
        ["+cl", "+cl+split", "+cl+both", "", "+tc", "+cl+split"]
    ops.device.compute_capability = (8, 9)               # no clusters before sm_90
    assert ops.cluster_decode_below() == 0 and ops.decode_rule(1, 19) == ""


@pytest.mark.parametrize("graphs", [False, True])
def test_cluster_decode_takes_rows_by_their_length(fake, rng, graphs):
    """cluster-decode (--kernels-on): decode rows of fewer than ops.cluster_below cells attend through
    strata_attention_decode_cl_* (the split-K and its combine in one launch, clusters of 16 blocks, allowed
    past the portable 8 first), longer ones through the split-K kernels and the combine: the same logits
    here, eager and in graphs keyed by the kernels they hold; a batch of both lengths launches both."""
    pack = open_pack(DEMO)
    ids = oracle_ids(pack, rng, 24)
    cl_name, split_name = "strata_attention_decode_cl_f16_d64_g2", "strata_attention_decode_f16_d64_g2"
    run = functools.partial(_prefill_then_decode, fake, pack, ids)
    base, _ = run(EngineConfig(cuda_graphs=graphs))
    assert cl_name not in fake.launches
    by_length, runner = run(EngineConfig(cuda_graphs=graphs, kernels_on="cluster-decode"), cluster_below=18)  # 13..24
    for a, b in zip(base, by_length):
        np.testing.assert_array_equal(a, b)
    assert cl_name in fake.launches and split_name in fake.launches and cl_name in set(fake.pdl_launches)
    if graphs:
        assert {"1+cl", 1} <= set(runner.graphs)
    # a prompt of 5 tokens (rows of 1..5 cells, through the decode kernels) across cluster_below 3: both
    # kernels, the cluster's after the combine, whose rows it writes over; the logits the same
    outs = []
    for config, below in ((EngineConfig(), None), (EngineConfig(kernels_on="cluster-decode"), 3)):
        fake.launches.clear()
        runner = CudaRunner(pack, 64, config)
        if below:
            runner.ops.cluster_below = below
        outs.append(runner.prefill(ids[:5], 0))
    names = [n for n in fake.launches if n in (cl_name, split_name, "strata_attention_decode_combine_f32")]
    assert names[:3] == [split_name, "strata_attention_decode_combine_f32", cl_name]
    np.testing.assert_array_equal(*outs)


def test_attention_trial_paths_a_model_never_takes_are_refused(fake, tmp_path):
    """--kernels-on wgmma-attention at a head dim its kernels lack would change nothing: refused in one
    line, before anything loads; tc-decode-attention is no trial path now (on by default, it takes only
    the rows and shapes it has kernels for)."""
    pytest.importorskip("torch")
    from tests.fixtures import SHAPES, make_pack
    path, _ = make_pack(tmp_path, SHAPES["odd"], seed=2)        # Dh 24
    with pytest.raises(UnsupportedError, match=r"kernel path wgmma-attention \(--kernels-on\): this model's .*head dim"):
        CudaRunner(open_pack(path), 32, EngineConfig(kernels_on="wgmma-attention"))
    with pytest.raises(InvalidArgument, match=r"kernel path 'tc-decode-attention' is on by default"):
        CudaRunner(open_pack(path), 32, EngineConfig(kernels_on="tc-decode-attention"))
    CudaRunner(open_pack(DEMO), 64, EngineConfig(kv="q4_0"))    # the default paths over a quantized cache


def test_fused_route_is_refused_where_the_model_never_takes_it():
    """--kernels-on fused-route needs F32 routers of at most 512 experts, top-k <= 32: refused in one line
    where the pack has other routers, before anything loads."""
    from strata.backends.cuda.kernels import KernelPaths
    from strata.engine import cuda_load
    args = open_pack(DEMO).args
    on = KernelPaths.without("", "fused-route")
    f32 = {f"blk.{l}.ffn_gate_inp.weight": {"qtype": "F32"} for l in range(2)}
    cuda_load.check_trial_paths(on, args, f32)
    cuda_load.check_trial_paths(KernelPaths(), args, {"blk.0.ffn_gate_inp.weight": {"qtype": "BF16"}})
    with pytest.raises(UnsupportedError, match=r"fused-route \(--kernels-on\): this model never takes it: its routers "
                                               r"are BF16, F32, not F32"):
        cuda_load.check_trial_paths(on, args, {**f32, "blk.1.ffn_gate_inp.weight": {"qtype": "BF16"}})
    with pytest.raises(UnsupportedError, match="routes 600 experts top-4, past the kernel's 512"):
        cuda_load.check_trial_paths(on, dataclasses.replace(args, num_experts=600), f32)


def test_emulated_runner_other_head_dims_and_f32_weights(fake, tmp_path, rng):
    pytest.importorskip("torch")
    from tests.fixtures import SHAPES, make_pack
    path, _ = make_pack(tmp_path, SHAPES["odd"], seed=2)        # Dh 24: the generic attention kernel
    pack = open_pack(path)
    gpu, cpu = CudaRunner(pack, 32), cpu_runner_f16_kv(pack, 32)
    ids = oracle_ids(pack, rng, 11)
    assert_close(gpu.logits_all(ids), cpu.logits_all(ids))
    assert_close(gpu.prefill(ids[:9], 0), cpu.prefill(ids[:9], 0))
    assert_close(gpu.decode(ids[9]), cpu.decode(ids[9]))
    assert "strata_attention_rows_f16" in fake.launches and "strata_moe_gate_up_route_f32" in fake.launches


def test_emulated_runner_k_quants_mixed_per_layer(fake, tmp_path, rng):
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from tests.fixtures import SHAPES, make_gguf_pack
    qtypes = {"attn": ["Q4_K", "Q8_0"], "experts": ["Q6_K", "Q4_K"], "embd": "Q6_K", "output": "Q8_0"}
    path, _ = make_gguf_pack(tmp_path, SHAPES["kquant"], qtypes, seed=4)
    pack = open_pack(path)
    gpu, cpu = CudaRunner(pack, 32), cpu_runner_f16_kv(pack, 32)
    ids = oracle_ids(pack, rng, 10)
    assert_close(gpu.logits_all(ids), cpu.logits_all(ids))
    assert_close(gpu.prefill(ids, 0), cpu.prefill(ids, 0))
    assert_close(gpu.decode(ids[0]), cpu.decode(ids[0]))
    assert {"strata_moe_down_q6_k", "strata_moe_gate_up_route_q4_k", "strata_moe_gemm_q4_k"} <= set(fake.launches)


def test_status_and_limits(fake):
    runner = CudaRunner(open_pack(DEMO), 64)
    runner.prefill([1, 2, 3], 0)
    s = runner.status()
    assert s["device"] == "cuda" and s["prefill_ring"] == 0 and s["prefill_chunk"] == 64
    assert set(s["gpu"]) == {"name", "vram_budget_bytes", "vram_used_bytes", "dense_bytes", "expert_cache_bytes",
                             "ring_bytes", "kv_bytes", "prompt_bytes"}
    cache = s["expert_cache"]
    assert cache["resident"] == cache["total_experts"] == 7 * 16 and cache["hits"] == 3 * 4 * 6
    assert s["bytes_h2d"] >= s["gpu"]["dense_bytes"] + s["gpu"]["expert_cache_bytes"]
    limits = runner.measure_limits(nbytes=1 << 24, repeats=2)
    assert limits["device_copy_gb_s"] > 0 and limits["h2d_gb_s"] > 0


def test_too_big_for_the_budget_says_so(fake):
    from strata.config import EngineConfig
    with pytest.raises(InvalidArgument, match=r"budget of \d+ bytes .* too small: the plan needs at least \d+ bytes"):
        CudaRunner(open_pack(DEMO), 64, EngineConfig(device="cuda", vram_budget_gib=0.01))


def test_group_by_expert(rng):
    ids = rng.integers(0, 9, (23, 4)).astype(np.int32)
    order, experts, starts, counts, rows = group_by_expert(ids)
    flat = ids.reshape(-1)
    assert (np.diff(flat[order]) >= 0).all() and counts.sum() == flat.size
    for e, s0, c in zip(experts, starts, counts):
        assert (flat[order[s0:s0 + c]] == e).all()
    assert (order[rows] == np.arange(flat.size)).all()          # rows[s] is where slot s went


def test_pool_reuses_and_coalesces(fake):
    pool = Pool(fake, fake.Device(0))
    a, _ = pool.alloc(1000)
    b, _ = pool.alloc(5000)
    assert (a.offset, b.offset, pool.used_bytes) == (0, 1024, 1024 + 5120)
    del a, b
    assert pool.used_bytes == 0 and pool.free == [[[0, pool.capacity_bytes]]]
    c, _ = pool.alloc(6000)
    assert c.offset == 0 and len(pool.segments) == 1
    big, _ = pool.alloc(pool.capacity_bytes)       # does not fit beside c: a second segment
    assert len(pool.segments) == 2 and big.seg == 1


@pytest.mark.parametrize("qtype, n", [("Q8_0", 64), ("Q4_K", 256), ("Q6_K", 2048), ("F32", 24), ("F16", 96)])
def test_gemv_grid_covers_every_row(qtype, n):
    for rows in (1, 7, 64, 1000, 151936):
        units = {"Q8_0": n // 32, "Q4_K": n // 64, "Q6_K": n // 64}.get(qtype, n // 8 if n % 8 == 0 else n)
        lanes = min(32, 1 << (max(units, 1) - 1).bit_length())
        krows = 2 if qtype in ("Q6_K", "F32", "F16") else 4
        assert gemv_grid(qtype, rows, n) * 4 * (32 // lanes) * krows >= rows


def test_whole_matrix_gemv_grid_is_capped_only_where_x_is_staged_once():
    head = gemv_grid("Q8_0", 151936, 2048)
    assert head == 9496
    for T in (1, 2, 4, 8):      # a row of 2048: one tile holds x for a group of up to 4 tokens
        assert gemv_whole_grid("Q8_0", 151936, 2048, T, 132) == 4 * 132
    assert gemv_whole_grid("Q8_0", 151936, 4096, 1, 132) == 4 * 132
    assert gemv_whole_grid("Q8_0", 151936, 4096, 2, 132) == 4 * 132
    assert gemv_whole_grid("Q8_0", 151936, 4096, 4, 132) == gemv_grid("Q8_0", 151936, 4096)    # tiles a round
    assert gemv_whole_grid("Q8_0", 151936, 8192, 1, 132) == gemv_grid("Q8_0", 151936, 8192)
    assert gemv_whole_grid("Q4_K", 151936, 2048, 1, 132) == gemv_grid("Q4_K", 151936, 2048)    # x not staged
    assert gemv_whole_grid("Q8_0", 64, 2048, 4, 132) == gemv_grid("Q8_0", 64, 2048)            # below the cap


def test_one_row_grids():
    """strata_gemv_one_* covers a quarter of the rows a block (one row a lane), capped at
    ONE_ROW_BLOCKS_PER_SM where x is staged once a block; the split rule then sees those blocks."""
    from strata.backends.cuda import memory
    assert gemv_grid("Q8_0", 2048, 4096) == 128 and gemv_grid("Q8_0", 2048, 4096, one_row=True) == 512
    assert gemv_whole_grid("Q8_0", 2048, 4096, 1, 132, one_row=True) == 512
    assert gemv_whole_grid("Q8_0", 151936, 2048, 1, 132, one_row=True) == memory.ONE_ROW_BLOCKS_PER_SM * 132
    assert gemv_grid("Q8_0", 300, 256, one_row=True) == -(-300 // 16)      # 8 lanes a row: 4 rows a warp


def test_the_grid_cap_mirrors_the_staged_kernels_constants():
    import re
    from pathlib import Path

    from strata.backends.cuda import memory
    src = (Path(__file__).resolve().parents[2] / "cuda" / "gemv_rows.cuh").read_text()
    assert int(re.search(r"#define STRATA_ROWS_GROUP (\d+)", src).group(1)) == memory.ROWS_GROUP
    assert int(re.search(r"kStageFloats = (\d+);", src).group(1)) == memory.STAGE_FLOATS
    assert int(re.search(r"kStride = (\d+);", src).group(1)) == memory.STAGE_STRIDE


def test_prefill_chunk_comes_from_the_plan(fake):
    pack = open_pack(DEMO)
    assert CudaRunner(pack, 64, EngineConfig(device="cuda", prefill="24")).prefill_chunk == 24
    assert CudaRunner(pack, 2048, EngineConfig(device="cuda", prefill="auto:512")).prefill_chunk == 512
    assert CudaRunner(pack, 300, EngineConfig(device="cuda")).prefill_chunk == 300     # auto: the context
    with pytest.raises(InvalidArgument, match="prefill must be a positive number"):
        CudaRunner(pack, 64, EngineConfig(device="cuda", prefill="0"))


def test_device_choice(monkeypatch):
    monkeypatch.setattr(cuda_backend, "unavailable_reason", lambda device=0: "no GPU here")
    assert llm_module._pick_device("auto") == "cpu" and llm_module._pick_device("cpu") == "cpu"
    with pytest.raises(DeviceError, match="no GPU here"):
        llm_module._pick_device("cuda")
    monkeypatch.setattr(cuda_backend, "unavailable_reason", lambda device=0: None)
    assert llm_module._pick_device("auto") == "cuda" == llm_module._pick_device("cuda")


# ---- decode as CUDA graphs, on the emulated runtime ------------------------------------------------

def _runners(pack, max_context):
    from strata.config import EngineConfig
    eager = CudaRunner(pack, max_context, EngineConfig(device="cuda", cuda_graphs=False))
    graph = CudaRunner(pack, max_context, EngineConfig(device="cuda", cuda_graphs=True))
    return eager, graph


def _attention_grids(runner) -> list:
    """Grids of the decode attention launches the runner makes from Python, in order."""
    grids, launch = [], runner.ops.launch

    def spy(op, grid, args, shared_bytes=0, **fields):
        if op == "attention_decode":
            grids.append(grid)
        launch(op, grid, args, shared_bytes, **fields)
    runner.ops.launch = spy
    return grids


def test_emulated_graph_decode_equals_eager_bitwise(fake, rng):
    pack = open_pack(DEMO)
    eager, graph = _runners(pack, 256)
    grids = _attention_grids(eager)
    ids = rng.integers(0, pack.args.vocab_size, 60).tolist()
    assert np.array_equal(eager.prefill(ids, 0), graph.prefill(ids, 0))
    grids.clear()
    for t in rng.integers(0, pack.args.vocab_size, 12).tolist():   # lengths 61..72: over a 64-cell tile
        assert np.array_equal(eager.decode(t), graph.decode(t))
    # one grid for every length: the splits follow the cache size, the length is read on the device
    assert len(set(grids)) == 1 and len(grids) == 12 * (pack.args.num_hidden_layers)
    assert len(fake.graph_launches) == 11 and graph.status()["decode"]["host_ms"]["graph"]["steps"] == 10
    assert "graph" not in eager.status()["decode"]["host_ms"] and not eager.graphs


def test_steps_queued_without_a_pick_read_their_own_inputs(fake, rng):
    """decode(logits=False) steps in a row, nothing synchronizing the stream between them, on a device
    that lags the host as far as it can (fake_cuda.lagging: each staging copy reads the pinned buffer
    when it runs): each step still reads its own token and position, so the next logits are those of
    steps picked one by one. The staging buffer was once rewritten before the copy of the step queued
    before had run, sending the newest inputs to every step still queued (#15)."""
    pack = open_pack(DEMO)
    ids = rng.integers(0, pack.args.vocab_size, 20).tolist()
    queued, picked = CudaRunner(pack, 64), CudaRunner(pack, 64)
    with fake.lagging():
        queued.prefill(ids[:9], 0, logits=False)
        for t in ids[9:-1]:
            queued.decode(t, logits=False)
        replays = len(fake.graph_launches)
        got = queued.decode(ids[-1])
    picked.prefill(ids[:9], 0, logits=False)
    for t in ids[9:-1]:
        picked.decode(t)
    assert np.array_equal(got, picked.decode(ids[-1]))
    assert replays == 9            # every step after the eager first one ran as the graph


def test_emulated_replay_runs_no_python_per_layer(fake, rng):
    pack = open_pack(DEMO)
    runner = CudaRunner(pack, 64)
    ids = rng.integers(0, pack.args.vocab_size, 9).tolist()
    runner.prefill(ids, 0)
    runner.decode(ids[0])                   # eager, measures the step
    runner.decode(ids[1])                   # captured, then launched
    g = runner.graphs[1]
    assert g.num_nodes > 9 * pack.args.num_hidden_layers and g.expert_uses == 6 * 4
    launched, uses = len(fake.launches), runner.ops.expert_uses
    assert uses == (9 + 2) * g.expert_uses                  # the prompt, the eager step, the captured one

    def no_python(*args, **kwargs):
        raise AssertionError("the model ran from Python during a replayed step")
    runner.model.forward = runner.model.layer = runner.ops.launch = no_python
    for t in ids[2:5]:
        runner.decode(t)
    assert len(fake.launches) == launched and fake.graph_launches == [g.num_nodes] * 4
    assert runner.ops.expert_uses == uses + 3 * g.expert_uses
    d = runner.decode_status()
    assert [d["host_ms"][m]["steps"] for m in ("eager", "capture", "graph")] == [1, 1, 3]
    assert d["graphs"][1]["nodes"] == g.num_nodes and d["graphs"][1]["pool_bytes"] >= runner._step_bytes[1]


def test_emulated_graphs_turned_off_after_a_capture_launch_from_python(fake, rng):
    pack = open_pack(DEMO)
    runner, cpu = CudaRunner(pack, 64), cpu_runner_f16_kv(pack, 64)
    ids = oracle_ids(pack, rng, 12)
    runner.prefill(ids[:5], 0)
    cpu.prefill(ids[:5], 0)
    for t in ids[5:8]:
        runner.decode(t), cpu.decode(t)
    runner.use_graphs = False               # the graph is kept, but not launched
    launched = len(fake.launches)
    for t in ids[8:]:
        assert_close(runner.decode(t), cpu.decode(t))
    assert len(fake.graph_launches) == 2 and len(fake.launches) > launched and 1 in runner.graphs


def test_emulated_graph_survives_prefix_reuse_and_prompts(fake, rng):
    pack = open_pack(DEMO)
    V = pack.args.vocab_size
    eager, graph = _runners(pack, 96)
    seq = oracle_ids(pack, rng, 38)            # b = seq[:35] and the 3 tokens decoded after it
    a, b, after = seq[:20], seq[:35], seq[35:]
    steps = seq[20:22] + [(seq[22] + 1) % V, int(rng.integers(0, V))]       # steps[2] is not b[22]
    for r in (eager, graph):
        r.prefill(a, 0)
    for t in steps:
        assert np.array_equal(eager.decode(t), graph.decode(t))
    captured = graph.graphs[1]
    starts = [r.reusable_prefix(b) for r in (eager, graph)]
    assert starts == [22, 22]
    assert np.array_equal(eager.prefill(b, 22), graph.prefill(b, 22))       # a prompt chunk on the main pool
    cpu = cpu_runner_f16_kv(pack, 96)         # the same path to the same cache: prompt, 2 steps, prompt
    cpu.prefill(a, 0)
    for t in steps[:2]:
        cpu.decode(t)
    cpu.prefill(b, 22)
    for t in after:
        ours = graph.decode(t)
        assert np.array_equal(eager.decode(t), ours)
        assert_close(ours, cpu.decode(t))
    assert graph.graphs[1] is captured and len(fake.graph_launches) == 6


def test_emulated_graph_memory_is_its_own_and_dies_with_it(fake, rng):
    from strata.backends.cuda.memory import DeviceKV
    pack = open_pack(DEMO)
    runner = CudaRunner(pack, 64)
    ids = oracle_ids(pack, rng, 8)
    runner.prefill(ids, 0)
    for t in ids[:2]:
        runner.decode(t)
    g = runner.graphs[1]
    pool = g.keep[0]
    main = {s.ptr for s in runner.ops.pool.segments}
    assert pool.frozen and len(pool.segments) == 1 and pool.segments[0].ptr not in main
    assert pool.capacity_bytes == Pool.block_bytes(runner._step_bytes[1])
    assert g.logits.buf is pool.segments[0] and g.kv is runner.kv
    # a new KV cache (a new max_context) moves the addresses: the graph is dropped and captured again
    a = pack.args
    old_segment = pool.segments[0].ptr
    del pool
    runner.kv = DeviceKV(fake, runner.dev, runner.stream, a.num_hidden_layers + a.num_mtp_layers, 64,
                         a.num_key_value_heads, a.head_dim)
    runner.reset()
    runner.prefill(ids, 0)
    cpu = cpu_runner_f16_kv(pack, 64)
    cpu.prefill(ids, 0)
    assert_close(runner.decode(ids[0]), cpu.decode(ids[0]))
    assert runner.graphs[1] is not g and runner.graphs[1].kv is runner.kv
    del g
    assert old_segment not in fake._bases            # the old graph's memory went with it
    runner.drop_graphs()
    assert not runner.graphs


def test_emulated_capture_failure_decodes_eagerly(fake, rng, capsys):
    pack = open_pack(DEMO)
    runner, cpu = CudaRunner(pack, 64), cpu_runner_f16_kv(pack, 64)
    ids = oracle_ids(pack, rng, 10)
    runner.prefill(ids[:6], 0)
    cpu.prefill(ids[:6], 0)
    assert_close(runner.decode(ids[6]), cpu.decode(ids[6]))
    runner._step_bytes[1] = 256             # too small a reserve: the capture would have to allocate
    for t in ids[7:]:
        assert_close(runner.decode(t), cpu.decode(t))
    d = runner.status()["decode"]
    assert not d["cuda_graphs"] and "reserved for a CUDA graph" in d["graph_error"] and not runner.graphs
    assert not fake.is_capturing(runner.stream) and not fake.graph_launches
    assert d["host_ms"]["eager"]["steps"] == 4 and "decoding without graphs" in capsys.readouterr().err


def test_emulated_capture_refuses_allocations_and_copies(fake):
    dev = fake.Device(0)
    stream = fake.Stream(dev)
    buf = fake.DeviceBuffer(dev, 64)
    fake.begin_capture(stream)
    for call in (lambda: fake.DeviceBuffer(dev, 64), stream.synchronize,
                 lambda: buf.copy_from_host(np.ones(4, np.float32), stream)):
        with pytest.raises(DeviceError, match="CAPTURE_UNSUPPORTED"):
            call()
    with pytest.raises(DeviceError, match="INVALIDATED"):     # those calls spoilt the capture
        fake.end_capture(stream)
    fake.begin_capture(stream)
    buf.fill_bytes(7, stream)               # recorded, not run
    graph = fake.end_capture(stream)
    assert graph.num_nodes == 1 and not (fake.view(buf.ptr, 64, np.uint8) == 7).any()
    graph.instantiate().launch(stream)
    stream.synchronize()
    assert (fake.view(buf.ptr, 64, np.uint8) == 7).all()


def test_cuda_graphs_setting(fake, monkeypatch, rng):
    from strata.config import EngineConfig
    assert EngineConfig().cuda_graphs is True
    monkeypatch.setenv("STRATA_CUDA_GRAPHS", "0")
    config = EngineConfig.from_kwargs(device="cuda")
    assert config.cuda_graphs is False
    runner = CudaRunner(open_pack(DEMO), 32, config)
    runner.prefill([1, 2, 3], 0)
    for t in rng.integers(0, 100, 4).tolist():
        runner.decode(t)
    assert not fake.graph_launches and not runner.graphs and runner.status()["decode"]["cuda_graphs"] is False


def test_emulated_k_quant_embedding_decodes_through_graphs(fake, tmp_path, rng):
    """A Q4_K embedding (once read on the host's ids, so decode ran eagerly) takes device-side ids."""
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from tests.fixtures import SHAPES, make_gguf_pack
    qtypes = {"attn": "Q8_0", "experts": "Q4_K", "embd": "Q4_K", "output": "Q8_0"}
    path, _ = make_gguf_pack(tmp_path, SHAPES["kquant"], qtypes, seed=5)
    pack = open_pack(path)
    gpu, cpu = CudaRunner(pack, 32), cpu_runner_f16_kv(pack, 32)
    ids = oracle_ids(pack, rng, 9)
    assert_close(gpu.prefill(ids[:6], 0), cpu.prefill(ids[:6], 0))
    for t in ids[6:]:
        assert_close(gpu.decode(t), cpu.decode(t))
    d = gpu.decode_status()
    assert d["cuda_graphs"] and fake.graph_launches and "strata_embed_q4_k" in fake.launches


def test_pick_on_the_device_equals_the_host_pick(fake, rng):
    """runner.pick (argmax / sample kernels, emulated) against strata.engine.sampler.pick_host on the
    same logits and draws; the two differ only for a draw within 1e-5 of a boundary."""
    from strata.backends.cuda.sample import sample_reference
    from strata.config import SamplingParams
    from strata.engine.sampler import pick_host
    pack = open_pack(DEMO)
    runner = CudaRunner(pack, 64)
    ids = rng.integers(0, pack.args.vocab_size, 9).tolist()
    for step in (lambda: runner.prefill(ids, 0), lambda: runner.decode(ids[0])):
        logits = step()
        for params in (SamplingParams(), SamplingParams(temperature=0.7, top_k=40, top_p=0.9),
                       SamplingParams(temperature=1.3, top_p=0.5), SamplingParams(temperature=1.0, top_k=3)):
            for u in rng.random(6):
                _, _, margin = sample_reference(logits[None], params.temperature, params.top_k, params.top_p, u,
                                                margins=True)
                if margin[0] > 1e-5:
                    assert runner.pick(params, u) == pick_host(logits, params, u), (params, u)
    assert {"strata_argmax_f32", "strata_sample_f32"} <= set(fake.launches)


def test_generation_picks_on_the_device_without_downloading_logits(fake, monkeypatch):
    """The generation loop never brings a step's logits to the host on the GPU: only the 4-byte pick."""
    calls = []
    real = DecodeSteps.download
    monkeypatch.setattr(DecodeSteps, "download", lambda self, logits: calls.append(1) or real(self, logits))
    llm = llm_module.LLM(device="cuda")
    cpu = llm_module.LLM(device="cpu")
    out = llm.generate("def f(x):", max_tokens=6, temperature=0.0)
    assert calls == [] and len(out.token_ids) > 0
    assert out.token_ids == cpu.generate("def f(x):", max_tokens=6, temperature=0.0).token_ids
    steps = {m: t["steps"] for m, t in llm.status()["decode"]["host_ms"].items()}
    assert sum(steps.values()) == len(out.token_ids) - 1     # each step timed until pick() had its token


def test_swap_library_launches_a_variants_kernels_until_swapped_back(fake, rng):
    """DeviceOps.swap_library (tools/decode_variants.py --fatbin-arms): after a swap, the library's kernels of
    later steps come from the variant's image, other libraries' from the package; swapping back (None)
    returns to the package's; graphs captured before are the caller's to drop."""
    pack = open_pack(DEMO)
    ids = oracle_ids(pack, rng, 14)
    runner = CudaRunner(pack, 64, EngineConfig(cuda_graphs=True))
    plain = [runner.prefill(ids[:8], 0)] + [runner.decode(t) for t in ids[8:10]]
    ops = runner.ops
    gemv_names = {n for n, k in ops._kernels.items() if k.library == "gemv"}
    assert gemv_names and all(getattr(ops._kernels[n], "image", None) is None for n in gemv_names)
    ops.swap_library("gemv", b"variant")
    runner.drop_graphs()
    runner.decode(ids[10])
    swapped = {n: k for n, k in ops._kernels.items() if k.library == "gemv"}
    assert swapped and all(k.image == b"variant" for k in swapped.values())
    assert all(k.image is None for k in ops._kernels.values() if k.library != "gemv")
    ops.swap_library("gemv", None)
    runner.drop_graphs()
    runner.decode(ids[11])
    assert all(k.image is None for k in ops._kernels.values())
    again = CudaRunner(pack, 64, EngineConfig(cuda_graphs=True))
    np.testing.assert_array_equal(again.prefill(ids[:8], 0), plain[0])


def test_cluster_decode_is_refused_where_it_cannot_run(fake, monkeypatch):
    """--kernels-on cluster-decode on a GPU before sm_90, or an install without code for this GPU's arch with
    clusters, is refused in one line, not left doing nothing."""
    pack = open_pack(DEMO)
    init = fake.Device.__init__

    def ada(self, ordinal=0):
        init(self, ordinal)
        self.compute_capability = (8, 9)
    monkeypatch.setattr(fake.Device, "__init__", ada)
    with pytest.raises(UnsupportedError, match="kernel path cluster-decode .*this one is sm_89"):
        CudaRunner(pack, 64, EngineConfig(kernels_on="cluster-decode"))
