"""--kv-resident N on the GPU (tests/engine/test_kv_resident_host.py runs the same on the emulated
runtime): the authoritative KV in mapped pinned host memory and the newest N cells of each layer in
a VRAM ring, appends to both, decode's split-K attention reading the older cells in place over the
bus and the newest from the ring, a prompt chunk's attention over the layer staged in VRAM (f16) or
dequantized from the host planes (the quantized formats). The kernels and their launch shapes are
the all-resident runner's and they read the same bytes, so the logits are bitwise equal; graph
decode bitwise equal to eager."""
import numpy as np
import pytest

from strata.engine.llm import demo_model_path
from strata.pack import open_pack
from tests.engine.kv_resident_checks import check_parallel_windows, check_spec_over_the_window, \
    check_windows_equal_all_resident, kv_runner

pytestmark = pytest.mark.gpu

RESIDENT = 16




@pytest.mark.parametrize("fmt", ["f16", "q4_0"])
def test_host_kv_logits_equal_all_resident_bitwise(rng, fmt):
    pack = open_pack(demo_model_path())
    V = pack.args.vocab_size
    vram, host = kv_runner(pack, 512, fmt), kv_runner(pack, 512, fmt, RESIDENT)
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
    eager = kv_runner(pack, 512, fmt, RESIDENT, cuda_graphs=False)
    graph = kv_runner(pack, 512, fmt, RESIDENT, cuda_graphs=True)
    ids = rng.integers(0, pack.args.vocab_size, 200).tolist()
    assert np.array_equal(eager.prefill(ids, 0), graph.prefill(ids, 0))
    for t in rng.integers(0, pack.args.vocab_size, 16).tolist():
        assert np.array_equal(eager.decode(t), graph.decode(t))
    assert graph.graphs and not eager.graphs


def test_host_kv_follow_up_turn_reuses_the_prefix(rng):
    pack = open_pack(demo_model_path())
    V = pack.args.vocab_size
    vram, host = kv_runner(pack, 512, "f16"), kv_runner(pack, 512, "f16", RESIDENT)
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
    check_windows_equal_all_resident(open_pack(demo_model_path()), rng, fmt, 512, 96, 300, 24, (40, 300, 400))


def test_window_cells_are_read_from_vram(rng):
    """The host's copies of the window's cells overwritten after a prompt: the next step's logits are
    still the all-resident ones (it reads those cells from the ring)."""
    pack = open_pack(demo_model_path())
    V = pack.args.vocab_size
    ids, step = rng.integers(0, V, 200).tolist(), int(rng.integers(0, V))
    vram, host = kv_runner(pack, 512, "q4_0"), kv_runner(pack, 512, "q4_0", 64)
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
    vram, host = kv_runner(pack, 512, fmt), kv_runner(pack, 512, fmt, 64)
    first = rng.integers(0, V, 400).tolist()
    second = first[:150] + rng.integers(0, V, 20).tolist()
    assert np.array_equal(vram.prefill(first, 0), host.prefill(first, 0))
    assert np.array_equal(vram.prefill(second, 150), host.prefill(second, 150))
    for t in rng.integers(0, V, 8).tolist():
        assert np.array_equal(vram.decode(t), host.decode(t))


@pytest.mark.parametrize("fmt", ["f16", "q4_0"])
def test_spec_over_the_window_is_plain_greedy(fmt):
    """--mtp --spec over the VRAM window: the ring's slack takes the rejected rows (kv_resident_checks)."""
    check_spec_over_the_window(fmt, RESIDENT)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")     # the garbage's NaNs
@pytest.mark.parametrize("fmt", ["f16", "q4_0"])
def test_parallel_slots_each_read_their_own_window(rng, fmt):
    """Each slot's VRAM ring (cuda/kv_codec.cuh vram_ring_first, strata_kv_ring_append by slot)."""
    check_parallel_windows(open_pack(demo_model_path()), rng, fmt, RESIDENT)
