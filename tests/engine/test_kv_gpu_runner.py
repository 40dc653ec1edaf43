"""CudaRunner with --kv int8, q4_0 and k8v4 on the GPU, on the demo model, against the CPU runner with
the same format (tests/engine/test_kv_gpu_runner_host.py runs the same on the emulated runtime).

Oracle: tests/engine/cpu_f16_kv.FormatKVOps (the CPU runner's cache of the same format, f16 rounding
of the dequantized cells in a prompt chunk, the tensor-core GEMMs' f16 inputs), its cells swapped for
the GPU's after each write (gpu_cells): the GPU's K and V differ from the CPU's by summation order,
and where that tips a value across a quantization boundary the two land a level apart (1/8 of a
4-bit block's largest value), which would swamp any bound on the engine. The swapped share is
bounded apart: MAX_FLIPS (0.3% measured on the emulated runtime; the device's tensor-core orders
differ more). With the cells shared, what is left is the f16 path's difference: REL = 3e-3 of the
largest logit, test_cuda_runner.py's device bound for f16 KV.

Without the swap, against the plain CPU runner of the format (f32 K/V arithmetic and GEMMs):
REL_UNSWAPPED per format, about 3x the flips' effect seen on the emulated runtime (9.7e-4 int8,
1.3e-2 k8v4 against this plain runner; 1.9e-2 q4_0 against the f16-modelled one): loose, yet a
missed un-rotation of V's output gives 0.7-0.9 there (k8v4).

Graph decode against eager decode: bitwise, as test_cuda_runner.py argues for f16.
"""
import numpy as np
import pytest

from strata.config import EngineConfig
from strata.engine.cuda_runner import CudaRunner
from strata.engine.llm import demo_model_path
from strata.engine.runner import CpuRunner
from strata.pack import open_pack
from tests.engine.cpu_f16_kv import cpu_runner_f16_kv, gpu_cells, oracle_ids

pytestmark = pytest.mark.gpu

FORMATS = ["int8", "q4_0", "k8v4"]
REL = 3e-3
MAX_FLIPS = 0.03
# without the swap, cells a level apart add up, at random with the ids: the H200 measured up to 1.04e-2
# (int8) and 1.4e-1 (q4_0) over two runs, then 3.2e-2 for int8 with seed 3923942545 (ids with router
# margins, 2026-12-02), so int8's is 5e-2 and the others about twice their measurement; a missed
# un-rotation gives about 0.8 (of a max|logit| near 12), past each. The bound on the engine itself is
# the swapped test's REL.
REL_UNSWAPPED = {"int8": 5e-2, "k8v4": 1.5e-1, "q4_0": 3e-1}
GAP = 2e-3          # router top-k margin of the oracle's draws (test_cuda_runner.py)


def _close(ours, ref, rel):
    bound = rel * np.abs(ref).max()
    err = np.abs(ours - ref).max()
    assert err <= bound, f"max err {err:.3g} > {bound:.3g}"


@pytest.fixture(scope="module")
def demo():
    return open_pack(demo_model_path())


@pytest.mark.parametrize("fmt", FORMATS)
def test_runner_matches_cpu_with_the_same_format(demo, rng, fmt):
    gpu = CudaRunner(demo, 512, EngineConfig(device="cuda", kv=fmt))
    cpu = cpu_runner_f16_kv(demo, 512, fmt)
    cpu.ops.cells_from = gpu_cells(gpu)
    gpu.prefill_chunk = cpu.prefill_chunk = 16      # chunks of 16, 16, 2: over several chunks' cells
    ids = oracle_ids(demo, rng, 40, chunk=16, gap=GAP, kv=fmt)
    _close(gpu.prefill(ids[:34], 0), cpu.prefill(ids[:34], 0), REL)
    for t in ids[34:]:
        _close(gpu.decode(t), cpu.decode(t), REL)
    assert cpu.ops.compared > 0 and cpu.ops.mismatched <= MAX_FLIPS * cpu.ops.compared, \
        (cpu.ops.mismatched, cpu.ops.compared)


@pytest.mark.parametrize("fmt", FORMATS)
def test_runner_near_the_plain_cpu_runner_of_the_format(demo, rng, fmt):
    gpu = CudaRunner(demo, 256, EngineConfig(device="cuda", kv=fmt))
    cpu = CpuRunner(demo, 256, kv=fmt)
    # ids whose router decisions have a margin (as the swapped test's): a near-tied top-k flips with
    # any rounding difference and moves the logits far past the bound (seed 4116562644 on the H200:
    # int8 0.726 > 0.273), which says nothing about the format's cells; the bound keeps its meaning
    ids = oracle_ids(demo, rng, 100, chunk=gpu.prefill_chunk, gap=GAP, kv=fmt)
    _close(gpu.prefill(ids[:95], 0), cpu.prefill(ids[:95], 0), REL_UNSWAPPED[fmt])
    for t in ids[95:]:
        _close(gpu.decode(t), cpu.decode(t), REL_UNSWAPPED[fmt])


@pytest.mark.parametrize("fmt", FORMATS)
def test_graph_decode_equals_eager_bitwise(demo, rng, fmt):
    eager = CudaRunner(demo, 512, EngineConfig(device="cuda", kv=fmt, cuda_graphs=False))
    graph = CudaRunner(demo, 512, EngineConfig(device="cuda", kv=fmt, cuda_graphs=True))
    ids = rng.integers(0, demo.args.vocab_size, 60).tolist()
    assert np.array_equal(eager.prefill(ids, 0), graph.prefill(ids, 0))
    for t in rng.integers(0, demo.args.vocab_size, 12).tolist():
        assert np.array_equal(eager.decode(t), graph.decode(t))
    assert graph.graphs and graph.status()["decode"]["host_ms"]["graph"]["steps"] == 10


@pytest.mark.parametrize("fmt", FORMATS)
def test_generation_with_each_format(fmt):
    """The whole engine on --kv fmt: the GPU's greedy tokens of a short prompt start as the CPU's of
    the same format, and each one is among the CPU's top 3 at its position (a quantized cell a level
    apart can tip a near-tie: on the H200, k8v4 parted from the CPU at the third token)."""
    from strata.engine.llm import LLM
    gpu = LLM(device="cuda", kv=fmt, max_context=256)
    cpu = LLM(device="cpu", kv=fmt, max_context=256)
    prompt = gpu.tokenizer.encode("def fib(n):")
    a = gpu.generate(prompt, max_tokens=16, temperature=0.0).token_ids
    b = cpu.generate(prompt, max_tokens=16, temperature=0.0).token_ids
    assert a[:2] == b[:2] and gpu.status()["kv"]["format"] == fmt
    logits = cpu.logits(prompt + a)[len(prompt) - 1:-1]                # the CPU's view of each GPU pick
    ranks = [int((row > row[t]).sum()) for row, t in zip(logits, a)]
    assert max(ranks) <= 2, ranks
