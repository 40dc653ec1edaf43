"""CudaRunner with a quantized KV cache (--kv int8, q4_0, k8v4) on the emulated runtime
(tests/engine/fake_cuda): the format's planes in DeviceKV, the decode step (QK-norm, RoPE, q rotated
where K is and the format's append in one launch, split-K decode over the planes, the combine
un-rotating the output where V is), the prompt path (the layer's cells dequantized into an f16 scratch
for the f16 prompt attention), CUDA graphs, and the planner's dry run of the same allocations.

Oracle: tests/engine/cpu_f16_kv.FormatKVOps, the CPU runner with the same format, whose cells are
swapped for the GPU runner's own after each write (gpu_cells): a K or V a rounding away from a
quantization boundary lands a level apart on the two sides (one level of a 4-bit block is 1/8 of
its largest value), and those flips would set the bound instead of the engine. The flips are
counted and bounded apart (MAX_FLIPS; <= 0.3% of the values measured, none in the first layers);
the logits then meet the f16 path's bound (1e-3 of the largest logit: test_cuda_runner_host.py)."""
import numpy as np
import pytest

from strata.backends.cuda.memory import Pool
from strata.config import EngineConfig
from strata.engine import memory_model, planner
from strata.engine.cuda_runner import CudaRunner
from strata.engine.llm import demo_model_path
from strata.engine.planner import PackSizes, bytes_needed, kv_bytes
from strata.errors import DeviceError, UnsupportedError
from strata.pack import open_pack
from strata.quant import kv as kvq
from tests.engine.cpu_f16_kv import cpu_runner_f16_kv, gpu_cells, oracle_ids
from tests.engine.test_cuda_runner_host import assert_close

DEMO = demo_model_path()
FORMATS = ["int8", "q4_0", "k8v4"]
MAX_FLIPS = 0.01        # share of the cells' values the two sides may quantize a level apart
CONTEXT = 1024


def _runner(pack, max_context, fmt, **kw):
    return CudaRunner(pack, max_context, EngineConfig(device="cuda", kv=fmt, **kw))


def _sizes(pack):
    return PackSizes.from_meta(pack.meta, pack.meta["files"]["dense.bin"]["bytes"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_emulated_runner_matches_cpu_with_the_same_format(fake, rng, fmt):
    pack = open_pack(DEMO)
    gpu, cpu = _runner(pack, 64, fmt), cpu_runner_f16_kv(pack, 64, fmt)
    cpu.ops.cells_from = gpu_cells(gpu)
    gpu.prefill_chunk = cpu.prefill_chunk = 12          # a chunk of 12, then one of 3 (the GEMV path)
    ids = oracle_ids(pack, rng, 20, chunk=12, kv=fmt)
    assert_close(gpu.prefill(ids[:15], 0), cpu.prefill(ids[:15], 0))
    prompt_launches = len(fake.launches)
    for t in ids[15:20]:
        assert_close(gpu.decode(t), cpu.decode(t))
    assert cpu.ops.compared > 0 and cpu.ops.mismatched <= MAX_FLIPS * cpu.ops.compared
    kc, vc = kvq.codecs(fmt)
    used, steps = set(fake.launches), set(fake.launches[prompt_launches:])
    combine = "strata_attention_decode_combine_rot_f32" if vc.rotated else "strata_attention_decode_combine_f32"
    # the chunk of 12: unfused norms, appends, the f16 scratch; of 3 and the steps: the fused append
    assert {f"strata_kv_append_{kc.name}", f"strata_kv_append_{vc.name}", f"strata_attention_decode_{fmt}_d64_g2",
            f"strata_kv_dequant_{kc.name}_f16", f"strata_kv_dequant_{vc.name}_f16", f"strata_qk_norm_rope_kv_{fmt}",
            "strata_attention_prefill_tc_f16_d64", combine} <= used
    assert not used & {"strata_kv_append_f16", "strata_qk_norm_rope_kv_f32"}     # the f16 cells' kernels
    assert ("strata_hadamard_f32" in used) == (kc.rotated or vc.rotated)
    # a step's attention: the fused append, split-K, the combine (un-rotating in it where V is rotated)
    assert not steps & {"strata_kv_append_int8", "strata_kv_append_q4r", "strata_hadamard_f32", "strata_rope_f32"}
    assert {f"strata_qk_norm_rope_kv_{fmt}", f"strata_attention_decode_{fmt}_d64_g2", combine} <= steps


def test_emulated_cells_are_the_formats_encoding(fake, rng):
    """Without the swap: the first layer's cells (inputs equal on both sides) are the CPU's bit for
    bit, but for values on a rounding boundary: the rotation's sums run in another order on each side,
    so a block scale whose f32 value sits on an f16 boundary may round one f16 ulp apart (1 of 48 V
    scales with STRATA_TEST_SEED=2989147216, before and after the ninth session), and that block's
    codes with it; and in a block whose scales agree, a rotated value on a code's boundary (y / d + 8.5
    an integer to f32 rounding) may take the next code (1 of 1,536 codes with STRATA_TEST_SEED=2442686595,
    at the 22nd session's head and after). So: a scale at most one ulp apart in at most 1 of 32 blocks,
    and in the blocks whose scales agree, a code at most one step apart in at most 1 of 256 codes."""
    pack = open_pack(DEMO)
    gpu, cpu = _runner(pack, 64, "q4_0"), cpu_runner_f16_kv(pack, 64, "q4_0")
    ids = oracle_ids(pack, rng, 12, kv="q4_0")
    gpu.prefill(ids[:10], 0), cpu.prefill(ids[:10], 0)
    for t in ids[10:]:
        gpu.decode(t), cpu.decode(t)
    theirs = gpu_cells(gpu)(0, np.arange(12))
    mine = [a[:12] for plane in cpu.kv.planes[0] for a in plane]
    for (values, scales), (their_values, their_scales) in zip(zip(mine[0::2], mine[1::2]),
                                                              zip(theirs[0::2], theirs[1::2])):
        ulps = np.abs(scales.view(np.int16).astype(np.int32) - their_scales.view(np.int16).astype(np.int32))
        assert ulps.max() <= 1 and (ulps > 0).sum() <= max(1, ulps.size // 32), ulps
        same = (ulps == 0).all(axis=-1)                         # cells x heads whose every scale agrees
        a, b = values[same], their_values[same]                 # q4r: two 4-bit codes a byte
        steps = np.concatenate([np.abs((a & 15).astype(int) - (b & 15)), np.abs((a >> 4).astype(int) - (b >> 4))])
        assert steps.max(initial=0) <= 1 and (steps > 0).sum() <= max(1, steps.size // 256), steps.max(initial=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_emulated_graph_decode_equals_eager_bitwise(fake, rng, fmt):
    pack = open_pack(DEMO)
    eager, graph = _runner(pack, 256, fmt, cuda_graphs=False), _runner(pack, 256, fmt, cuda_graphs=True)
    ids = rng.integers(0, pack.args.vocab_size, 60).tolist()
    assert np.array_equal(eager.prefill(ids, 0), graph.prefill(ids, 0))
    for t in rng.integers(0, pack.args.vocab_size, 8).tolist():   # lengths 61..68: over a 64-cell tile
        assert np.array_equal(eager.decode(t), graph.decode(t))
    assert len(fake.graph_launches) == 7 and graph.status()["decode"]["host_ms"]["graph"]["steps"] == 6


@pytest.mark.parametrize("fmt", FORMATS)
def test_kv_planes_are_the_planners_bytes(fake, fmt):
    pack = open_pack(DEMO)
    a = pack.args
    runner = _runner(pack, 96, fmt)
    layers = a.num_hidden_layers + a.num_mtp_layers
    assert runner.kv.nbytes == kv_bytes(a, 96, fmt, layers) == runner.plan.mandatory["kv"]
    assert runner.kv.nbytes < kv_bytes(a, 96, "f16", layers)
    assert runner.status()["gpu"]["kv_bytes"] == runner.kv.nbytes and runner.status()["kv"]["format"] == fmt
    kc, vc = kvq.codecs(fmt)
    planes = [p for codec in (kc, vc) for p in codec.empty((96, a.num_key_value_heads), a.head_dim)]
    assert [buf.nbytes for buf, _ in runner.kv.buffers] == [layers * p.nbytes for p in planes]


@pytest.mark.parametrize("fmt", FORMATS)
def test_dry_run_is_the_runners_memory(fake, rng, fmt):
    """memory_model over a quantized DeviceKV: a prompt chunk's pool peak (its f16 scratch counted)
    and a decode step's bytes equal what the runner allocates; the graph reserve is that step's."""
    pack = open_pack(DEMO)
    sizes = _sizes(pack)
    for T in (5, 130):
        runner = _runner(pack, CONTEXT, fmt)
        runner.prefill_chunk = T
        base = runner.ops.pool.used_bytes
        runner.prefill(rng.integers(0, pack.args.vocab_size, T).tolist(), 0)
        peak = memory_model.prompt_pool_bytes(sizes, T, CONTEXT, 8, resident=True, kv=fmt)
        assert runner.ops.pool.peak_bytes - base == peak
    runner = _runner(pack, 512, fmt)
    runner.prefill(rng.integers(0, 8000, 5).tolist(), 0)
    pool = runner.ops.pool
    pool.peak_bytes = base = pool.used_bytes
    runner.decode(1)
    peak, total = memory_model.decode_step_bytes(sizes, 1, 512, 8, kv=fmt)
    assert (pool.peak_bytes - base, runner._step_bytes[1]) == (peak, total)
    runner.decode(2)
    assert runner.graphs[1].keep[0].capacity_bytes == Pool.block_bytes(total)
    items = planner.mandatory_items(sizes, EngineConfig(max_context=512, kv=fmt), num_sms=8)
    assert items["graphs"] == Pool.block_bytes(total) and items["kv"] == runner.kv.nbytes


def test_bytes_needed_reads_a_quantized_prompt_to_the_context_end(fake, rng):
    """A frozen pool of bytes_needed's pool part for the format reads a prompt in chunks through
    the f16 scratch of the layer's cells (the whole context's, whatever the positions), up to the
    context's end; 256 bytes less does not, nor the pool of a shorter context's scratch."""
    pack = open_pack(DEMO)
    sizes, T, context = _sizes(pack), 100, 512
    arena = memory_model.prompt_arena_bytes(sizes, T, context, kv="k8v4")
    assert (bytes_needed(sizes, T, context, kv="k8v4")
            == arena + memory_model.zeros_bytes(sizes, T) - memory_model.ZEROS_MIN_BYTES)

    def run(nbytes, n):
        runner = _runner(pack, context, "k8v4")
        runner.prefill_chunk = T
        runner.ops.pool = Pool(fake, runner.dev, reserve_bytes=nbytes)
        runner.prefill(rng.integers(0, pack.args.vocab_size, n).tolist(), 0)
    for n in (3 * T, context - 12, context):
        run(arena, n)
    for nbytes in (arena - 256, memory_model.prompt_arena_bytes(sizes, T, 3 * T, kv="k8v4")):
        with pytest.raises(DeviceError, match="do not fit"):
            run(nbytes, 3 * T)


def test_emulated_warm_up_gives_the_planes_back(fake, rng):
    pack = open_pack(DEMO)
    runner = _runner(pack, 64, "k8v4")
    runner.prefill(rng.integers(0, pack.args.vocab_size, 7).tolist(), 0)
    before = [fake.view(buf.ptr, buf.nbytes, np.uint8).copy() for buf, _ in runner.kv.buffers]
    runner.warm_up()
    assert runner.graphs and fake.launches.count("strata_kv_append_q4r") > 0
    for (buf, _), old in zip(runner.kv.buffers, before):
        assert np.array_equal(fake.view(buf.ptr, buf.nbytes, np.uint8), old)


def test_quantized_kv_refuses_head_dims_its_kernels_lack(fake, tmp_path):
    pytest.importorskip("torch")
    from tests.fixtures import SHAPES, make_pack
    path, _ = make_pack(tmp_path, SHAPES["odd"], seed=2)        # Dh 24
    pack = open_pack(path)
    with pytest.raises(UnsupportedError, match="head dims"):
        _runner(pack, 32, "int8")
    assert _runner(pack, 32, "f16").kv.fmt == "f16"


def test_emulated_streamed_experts_equal_resident_with_a_quantized_kv(fake, rng):
    """Experts streaming: each prompt runs in the loan bytes_needed sized for the format (its f16
    scratch inside), and the logits are the resident runner's bit for bit."""
    pack = open_pack(DEMO)

    def runner(**config):
        return CudaRunner(pack, 96, EngineConfig(device="cuda", prefill="24", kv="q4_0", **config))
    resident, streamed = runner(), runner(expert_cache="20")
    assert resident.store.resident and not streamed.store.resident
    ids = rng.integers(0, pack.args.vocab_size, 60).tolist()
    np.testing.assert_array_equal(streamed.prefill(ids[:52], 0), resident.prefill(ids[:52], 0))
    for t in ids[52:]:
        np.testing.assert_array_equal(streamed.decode(t), resident.decode(t))
    assert streamed.status()["expert_cache"]["prompt_streamed"] > 0 and streamed.graphs
