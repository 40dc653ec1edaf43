"""--kv-resident N on the GPU (tests/engine/test_kv_resident_host.py runs the same on the emulated
runtime): the authoritative KV in mapped pinned host memory and the newest N cells of each layer in
a VRAM ring, appends to both, decode's split-K attention reading the older cells in place over the
bus and the newest from the ring, a prompt chunk's attention over the layer staged in VRAM (f16) or
dequantized from the host planes (the quantized formats). The kernels and their launch shapes are
the all-resident runner's and they read the same bytes, so the logits are bitwise equal; graph
decode bitwise equal to eager."""
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
    assert host.kv.on_host and host.status()["kv"]["cells_vram"] == RESIDENT
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


@pytest.mark.parametrize("fmt", ["f16", "int8", "q4_0", "k8v4"])
def test_window_logits_equal_all_resident_bitwise(rng, fmt):
    """Windows smaller than a chunk, equal to the prompt, and larger than the whole sequence; the prompt
    in chunks of 96 (the prompt kernels) and a last one of 12 (the step kernels over host and ring),
    then steps across the window's length: logits and cells bitwise the all-resident runner's."""
    pack = open_pack(demo_model_path())
    V = pack.args.vocab_size
    ids, steps = rng.integers(0, V, 300).tolist(), rng.integers(0, V, 24).tolist()
    vram = _runner(pack, 512, fmt)
    vram.prefill_chunk = 96
    want = [vram.prefill(ids, 0)] + [vram.decode(t) for t in steps]
    for window in (40, 300, 400):
        host = _runner(pack, 512, fmt, window)
        host.prefill_chunk = 96
        assert host.kv.vram_window == window and host.status()["kv"]["cells_vram"] == window
        got = [host.prefill(ids, 0)] + [host.decode(t) for t in steps]
        for i, (g, w) in enumerate(zip(got, want)):
            assert np.array_equal(g, w), (window, i)
        for (x, _), (y, _) in zip(host.kv.buffers, vram.kv.buffers):
            a, b = np.empty(x.nbytes, np.uint8), np.empty(y.nbytes, np.uint8)
            x.copy_to_host(a, host.stream)
            y.copy_to_host(b, vram.stream)
            assert np.array_equal(a, b)
        assert host.graphs, host.graph_error


def test_window_cells_are_read_from_vram(rng):
    """The host's copies of the window's cells overwritten after a prompt: the next step's logits are
    still the all-resident ones (it reads those cells from the ring)."""
    pack = open_pack(demo_model_path())
    V = pack.args.vocab_size
    ids, step = rng.integers(0, V, 200).tolist(), int(rng.integers(0, V))
    vram, host = _runner(pack, 512, "q4_0"), _runner(pack, 512, "q4_0", 64)
    assert np.array_equal(vram.prefill(ids, 0), host.prefill(ids, 0))
    lo = host.kv.vram_from(len(ids) + 1)
    for layer in range(host.kv.num_layers):
        for (plane, _), (addr, cell) in zip(host.kv.buffers, host.kv.cell_ranges(layer)):
            junk = rng.integers(0, 256, cell * (len(ids) - lo), dtype=np.uint8)
            plane.copy_from_host(junk, host.stream, offset=addr - plane.ptr + lo * cell)
    assert np.array_equal(vram.decode(step), host.decode(step))


@pytest.mark.parametrize("fmt", ["f16", "k8v4"])
def test_window_refilled_when_a_prompt_reuses_a_prefix(rng, fmt):
    pack = open_pack(demo_model_path())
    V = pack.args.vocab_size
    vram, host = _runner(pack, 512, fmt), _runner(pack, 512, fmt, 64)
    first = rng.integers(0, V, 400).tolist()
    second = first[:150] + rng.integers(0, V, 20).tolist()
    assert np.array_equal(vram.prefill(first, 0), host.prefill(first, 0))
    assert np.array_equal(vram.prefill(second, 150), host.prefill(second, 150))
    for t in rng.integers(0, V, 8).tolist():
        assert np.array_equal(vram.decode(t), host.decode(t))
