"""--kv-resident N on the GPU (tests/engine/test_kv_resident_host.py runs the same on the emulated
runtime): the KV in mapped pinned host memory, decode's appends and split-K attention reading it in
place over the bus, a prompt chunk's attention over the layer staged in VRAM (f16) or dequantized
from the host planes (q4_0). The kernels and their launch shapes are the all-resident runner's and
they read the same bytes, so the logits are bitwise equal; graph decode bitwise equal to eager."""
import numpy as np
import pytest

from strata.config import EngineConfig
from strata.engine.cuda_runner import CudaRunner
from strata.engine.llm import demo_model_path
from strata.pack import open_pack

pytestmark = pytest.mark.gpu

RESIDENT = 16


def _runner(pack, max_context, fmt, resident=0, **kw):
    return CudaRunner(pack, max_context, EngineConfig(device="cuda", kv=fmt, kv_resident=resident, **kw))


@pytest.mark.parametrize("fmt", ["f16", "q4_0"])
def test_host_kv_logits_equal_all_resident_bitwise(rng, fmt):
    pack = open_pack(demo_model_path())
    V = pack.args.vocab_size
    vram, host = _runner(pack, 512, fmt), _runner(pack, 512, fmt, RESIDENT)
    assert host.kv.on_host and host.status()["kv"]["cells_vram"] == 0
    vram.prefill_chunk = host.prefill_chunk = 96
    ids = rng.integers(0, V, 300).tolist()               # chunks of 96 (the prompt kernels), then 12
    assert np.array_equal(vram.prefill(ids, 0), host.prefill(ids, 0))
    for t in rng.integers(0, V, 24).tolist():           # lengths 301..324
        assert np.array_equal(vram.decode(t), host.decode(t))
    assert host.graphs, host.graph_error


@pytest.mark.parametrize("fmt", ["f16", "q4_0"])
def test_host_kv_graph_decode_equals_eager(rng, fmt):
    pack = open_pack(demo_model_path())
    eager = _runner(pack, 512, fmt, RESIDENT, cuda_graphs=False)
    graph = _runner(pack, 512, fmt, RESIDENT, cuda_graphs=True)
    ids = rng.integers(0, pack.args.vocab_size, 200).tolist()
    assert np.array_equal(eager.prefill(ids, 0), graph.prefill(ids, 0))
    for t in rng.integers(0, pack.args.vocab_size, 16).tolist():
        assert np.array_equal(eager.decode(t), graph.decode(t))
    assert graph.graphs and not eager.graphs


def test_host_kv_follow_up_turn_reuses_the_prefix(rng):
    pack = open_pack(demo_model_path())
    V = pack.args.vocab_size
    vram, host = _runner(pack, 512, "f16"), _runner(pack, 512, "f16", RESIDENT)
    seq = rng.integers(0, V, 260).tolist()
    a, b = seq[:120], seq[:250]
    steps = seq[120:124] + [(seq[124] + 1) % V]
    assert np.array_equal(vram.prefill(a, 0), host.prefill(a, 0))
    for t in steps:
        assert np.array_equal(vram.decode(t), host.decode(t))
    assert [r.reusable_prefix(b) for r in (vram, host)] == [124, 124]
    assert np.array_equal(vram.prefill(b, 124), host.prefill(b, 124))
    for t in seq[250:260]:
        assert np.array_equal(vram.decode(t), host.decode(t))
