"""--kv-resident N on the emulated runtime (tests/engine/fake_cuda): the authoritative KV in mapped
pinned host memory (DeviceKV on_host, HostPlane) and the newest N cells of each layer in a VRAM ring
(the window); appends write both, decode reads the cells older than the window in place over the bus
and the newest from the ring, a prompt chunk's attention reads the layer staged in VRAM (f16) or
dequantized from the host planes (the quantized formats). Logits are bitwise those of the same
runner with every cell in VRAM: the kernels read the same bytes, only from elsewhere."""

import numpy as np
import pytest

from strata.backends.cuda.memory import HostPlane
from strata.config import KV_VRAM_SLACK, EngineConfig
from strata.engine import memory_model
from strata.engine.llm import demo_model_path
from strata.engine.planner import PackSizes, kv_bytes
from strata.errors import InvalidArgument
from strata.pack import open_pack
from tests.engine.kv_resident_checks import (SPEC_PROMPTS, check_parallel_windows, check_spec_over_the_window,
                                             check_windows_equal_all_resident, greedy_with_changing_windows,
                                             kv_runner)

DEMO = demo_model_path()
RESIDENT = 16           # below every context here: the cells live on the host




def _sizes(pack):
    return PackSizes.from_meta(pack.meta, pack.meta["files"]["dense.bin"]["bytes"])


@pytest.mark.parametrize("fmt", ["f16", "q4_0"])
def test_host_kv_logits_equal_all_resident_bitwise(fake, rng, fmt):
    """A prompt longer than N in chunks of 12 (the prompt kernels) and of 4 (the step kernels), then
    decode steps past it: every logit as with all cells in VRAM."""
    pack = open_pack(DEMO)
    V = pack.args.vocab_size
    vram, host = kv_runner(pack, 96, fmt), kv_runner(pack, 96, fmt, RESIDENT)
    assert host.kv.on_host and all(isinstance(b, HostPlane) for b, _ in host.kv.buffers)
    assert not vram.kv.on_host and host.kv.host_bytes == vram.kv.nbytes
    assert host.kv.vram_window == RESIDENT
    assert host.kv.vram_bytes == vram.kv.nbytes * (RESIDENT + KV_VRAM_SLACK) // 96
    vram.prefill_chunk = host.prefill_chunk = 12
    ids = rng.integers(0, V, 40).tolist()                      # 12 + 12 + 12 + 4 > N
    assert np.array_equal(vram.prefill(ids, 0), host.prefill(ids, 0))
    for t in rng.integers(0, V, 8).tolist():
        assert np.array_equal(vram.decode(t), host.decode(t))
    for (a, _), (b, _) in zip(vram.kv.buffers, host.kv.buffers):   # the cells themselves, bit for bit
        got = np.empty(b.nbytes, np.uint8)
        b.copy_to_host(got, host.stream)
        want = np.empty(a.nbytes, np.uint8)
        a.copy_to_host(want, vram.stream)
        assert np.array_equal(got, want)
    staged = host.ops.bytes_staged_kv
    if fmt == "f16":            # three chunks of 12 staged every main layer's K and V, the cells each reads
        layers = pack.args.num_hidden_layers
        assert staged == (12 + 24 + 36) * layers * 2 * host.kv.buffers[0][1]
    else:                       # a quantized prompt dequantizes from the host planes in place
        assert staged == 0
    assert host.graphs and vram.graphs                        # decode steps ran as CUDA graphs


@pytest.mark.parametrize("fmt", ["f16", "q4_0"])
def test_host_kv_graph_decode_equals_eager(fake, rng, fmt):
    pack = open_pack(DEMO)
    eager = kv_runner(pack, 128, fmt, RESIDENT, cuda_graphs=False)
    graph = kv_runner(pack, 128, fmt, RESIDENT, cuda_graphs=True)
    ids = rng.integers(0, pack.args.vocab_size, 60).tolist()
    assert np.array_equal(eager.prefill(ids, 0), graph.prefill(ids, 0))
    for t in rng.integers(0, pack.args.vocab_size, 8).tolist():   # lengths 61..68: over a 64-cell tile
        assert np.array_equal(eager.decode(t), graph.decode(t))
    assert len(fake.graph_launches) == 7 and not eager.graphs


def test_host_kv_follow_up_turn_reuses_the_prefix(fake, rng):
    """A second turn sharing the first's prompt and steps up to a point reads only the rest; its
    logits and steps as an all-resident runner's on the same path."""
    pack = open_pack(DEMO)
    V = pack.args.vocab_size
    vram, host = kv_runner(pack, 96, "f16"), kv_runner(pack, 96, "f16", RESIDENT)
    for r in (vram, host):
        r.prefill_chunk = 12
    seq = rng.integers(0, V, 50).tolist()
    a, b = seq[:20], seq[:45]
    steps = seq[20:24] + [(seq[24] + 1) % V]                       # the fifth step is not b's
    assert np.array_equal(vram.prefill(a, 0), host.prefill(a, 0))
    for t in steps:
        assert np.array_equal(vram.decode(t), host.decode(t))
    starts = [r.reusable_prefix(b) for r in (vram, host)]
    assert starts == [24, 24]
    assert np.array_equal(vram.prefill(b, 24), host.prefill(b, 24))
    for t in seq[45:50]:
        assert np.array_equal(vram.decode(t), host.decode(t))


@pytest.mark.parametrize("fmt", ["f16", "q4_0"])
def test_host_kv_plan_and_status(fake, rng, fmt):
    pack = open_pack(DEMO)
    a = pack.args
    layers = a.num_hidden_layers + a.num_mtp_layers
    host = kv_runner(pack, 96, fmt, RESIDENT)
    plan = host.plan
    # the window's ring: its cells and the slack speculation's rejected rows land in
    assert plan.mandatory["kv"] == kv_bytes(a, RESIDENT + KV_VRAM_SLACK, fmt, layers) == host.kv.vram_bytes
    assert plan.kv_cells == RESIDENT
    assert plan.kv_host_bytes == kv_bytes(a, 96, fmt, layers) == host.kv.host_bytes
    assert plan.kv_bus_bytes_per_token == kv_bytes(a, 96 - RESIDENT, fmt, layers)
    host.prefill(rng.integers(0, a.vocab_size, 30).tolist(), 0)
    st = host.status()
    assert st["kv"]["format"] == fmt and st["kv"]["cells_vram"] == RESIDENT and st["kv"]["cells_host"] == 96
    # the next token reads 31 cells: the newest 16 from the window, 15 over the bus
    assert st["kv"]["bus_bytes_per_token"] == kv_bytes(a, 31 - RESIDENT, fmt, layers)
    assert st["gpu"]["kv_bytes"] == host.kv.vram_bytes == st["kv"]["vram_bytes"]
    # N at or above the context: every cell in VRAM, as without the flag
    whole = kv_runner(pack, 96, fmt, 96)
    assert not whole.kv.on_host and whole.status()["kv"]["cells_vram"] == 96 and whole.plan.kv_host_bytes == 0


@pytest.mark.parametrize("fmt", ["f16", "q4_0"])
def test_host_kv_dry_run_is_the_runners_prompt_memory(fake, rng, fmt):
    """The planner's prompt pricing over the host KV (key fmt+host: the f16 staging) is the pool the
    runner's chunk takes, and the closed form equals the dry run."""
    pack = open_pack(DEMO)
    sizes = _sizes(pack)
    key = fmt + memory_model.HOST_SUFFIX
    for T in (130, 260):
        runner = kv_runner(pack, 512, fmt, RESIDENT)
        runner.prefill_chunk = T
        base = runner.ops.pool.used_bytes
        runner.prefill(rng.integers(0, pack.args.vocab_size, T).tolist(), 0)
        peak = memory_model.prompt_pool_bytes(sizes, T, 512, 8, resident=True, kv=key)
        assert runner.ops.pool.peak_bytes - base == peak
        dry = memory_model.dry_run_prompt(sizes, T, 2, 512, 8, kv=key)
        assert memory_model.closed_form(T) and dry[:2] == memory_model._prompt(sizes, T, 2, 512, 8, kv=key)[:2]
    if fmt == "f16":        # a long context: the staging (two f16 copies of a layer) sets the peak
        one = sizes.args.num_key_value_heads * sizes.args.head_dim * 2 * 65536
        plain = memory_model.prompt_pool_bytes(sizes, 260, 65536, 8, resident=True, kv="f16")
        staged = memory_model.prompt_pool_bytes(sizes, 260, 65536, 8, resident=True, kv=key)
        assert plain < staged <= plain + 2 * one


FORMATS = ["f16", "int8", "q4_0", "k8v4"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_window_logits_equal_all_resident_bitwise(fake, rng, fmt):
    """Windows smaller than the prompt (and than a chunk: a chunk's oldest rows are not copied into the
    ring), equal to the prompt and larger than the whole sequence: a prompt in chunks of 12 (the prompt
    kernels) and a last one of 4 (the step kernels, reading host and ring), then decode steps that cross
    the window's length; every logit and cell as with all cells in VRAM."""
    check_windows_equal_all_resident(open_pack(DEMO), rng, fmt, 96, 12, 40, 8, (8, 40, 64))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")     # the garbage's NaNs
@pytest.mark.parametrize("fmt", ["f16", "q4_0"])
def test_window_cells_are_read_from_vram(fake, rng, fmt):
    """After a prompt, the host's copies of the cells in the window are overwritten with garbage: the
    next step reads those cells from the ring, so its logits are still the all-resident ones (and
    garbage in the cells older than the window does change them: those are read over the bus)."""
    pack = open_pack(DEMO)
    V = pack.args.vocab_size
    ids, step = rng.integers(0, V, 30).tolist(), int(rng.integers(0, V))
    vram, host, older = (kv_runner(pack, 96, fmt, n) for n in (0, RESIDENT, RESIDENT))
    want = [vram.prefill(ids, 0), vram.decode(step)]
    assert np.array_equal(host.prefill(ids, 0), want[0]) and np.array_equal(older.prefill(ids, 0), want[0])
    lo = host.kv.vram_from(len(ids) + 1)                  # the first step reads cells lo.. from the ring
    for r, cells in ((host, range(lo, len(ids))), (older, range(lo - 4, lo))):
        for layer in range(r.kv.num_layers):
            for (plane, _), (addr, cell) in zip(r.kv.buffers, r.kv.cell_ranges(layer)):
                junk = rng.integers(0, 256, cell * len(cells), dtype=np.uint8)
                plane.copy_from_host(junk, r.stream, offset=addr - plane.ptr + cells[0] * cell)
    assert np.array_equal(host.decode(step), want[1])
    assert not np.array_equal(older.decode(step), want[1])


@pytest.mark.parametrize("fmt", ["f16", "int8"])
def test_window_refilled_when_a_prompt_reuses_a_prefix(fake, rng, fmt):
    """A long first conversation leaves the ring holding its newest cells; a second one reusing only a
    shorter prefix of it must find that prefix's newest cells in the ring (DeviceKV.vram_refill)."""
    pack = open_pack(DEMO)
    V = pack.args.vocab_size
    vram, host = kv_runner(pack, 128, fmt), kv_runner(pack, 128, fmt, RESIDENT)
    first = rng.integers(0, V, 70).tolist()
    second = first[:30] + rng.integers(0, V, 6).tolist()
    for r in (vram, host):
        r.prefill_chunk = 16
    assert np.array_equal(vram.prefill(first, 0), host.prefill(first, 0))
    assert vram.reusable_prefix(second) == host.reusable_prefix(second) == 30
    assert np.array_equal(vram.prefill(second, 30), host.prefill(second, 30))
    for t in rng.integers(0, V, 4).tolist():
        assert np.array_equal(vram.decode(t), host.decode(t))


def test_window_after_a_warm_up_between_turns(fake, rng):
    """A warm-up between two turns writes its own cells into the ring and puts the host cells back
    only: the second turn (reusing the first's prefix) still equals the all-resident runner's."""
    pack = open_pack(DEMO)
    V = pack.args.vocab_size
    vram, host = kv_runner(pack, 96, "int8"), kv_runner(pack, 96, "int8", RESIDENT)
    first = rng.integers(0, V, 30).tolist()
    second = first + rng.integers(0, V, 5).tolist()
    for r in (vram, host):
        r.prefill(first, 0)
        r.warm_up(24, 3)
    assert host.reusable_prefix(second) == 30
    assert np.array_equal(vram.prefill(second, 30), host.prefill(second, 30))
    for t in rng.integers(0, V, 4).tolist():
        assert np.array_equal(vram.decode(t), host.decode(t))


def test_vram_refill_copies():
    """vram_refill's copies: the window's newest cells of a length, at most two ranges a plane and
    layer, at their slots in the ring of window + KV_VRAM_SLACK cells."""
    from types import SimpleNamespace
    from strata.backends.cuda.memory import DeviceKV
    assert KV_VRAM_SLACK == 16
    kv = object.__new__(DeviceKV)
    kv.__dict__.update(num_layers=1, vram_window=8, vram_ring_cells=24, layer_cells=64, base=0, num_kv_heads=1,
                       head_dim=64, buffers=[(SimpleNamespace(ptr=0), 2)], vram_rings=[SimpleNamespace(ptr=1000)],
                       num_slots=1, max_cells=64)
    assert kv.vram_refill(5) == [(1000, 0, 10)]                      # cells 0..4 at slots 0..4
    assert kv.vram_refill(13) == [(1000 + 10, 10, 16)]               # cells 5..12 at 5..12
    assert kv.vram_refill(30) == [(1000 + 44, 44, 4), (1000, 48, 12)]  # cells 22, 23 at 22, 23, 24..29 at 0..5
    # slot 1 of two (a view): its cells from cell 32 on, its ring the 24 cells after slot 0's
    kv.__dict__.update(num_slots=2, max_cells=32, base=32)
    assert kv.vram_refill(5) == [(1000 + 48, 64, 10)]


def test_host_kv_config_refusals():
    EngineConfig(kv_resident=64, device="cuda")
    EngineConfig(kv_resident=64, device="cuda", spec="2", mtp=True)      # speculation over the window
    EngineConfig(kv_resident=64, device="cuda", parallel=2)               # a window per slot
    for kw, what in (({"device": "cpu"}, "CPU"),
                     ({"spec": "2", "mtp": True, "draft_window": 32}, "--draft-window")):
        with pytest.raises(InvalidArgument, match=what):
            EngineConfig(kv_resident=64, **kw)



@pytest.mark.parametrize("fmt", ["f16", "q4_0"])
def test_spec_over_the_window_is_plain_greedy(fake, fmt):
    """--mtp --spec with the cells on the host and a 16-cell VRAM window (every layer's, the draft
    layer's too): rejected verify rows and drafts land in the ring's slack, never on a cell a later
    row reads, so the tokens are plain greedy's with every cell in VRAM (kv_resident_checks)."""
    check_spec_over_the_window(fmt, RESIDENT)


def test_spec_over_the_window_needs_the_slack(fake, monkeypatch):
    """The same with the ring as wide as its window (no slack; the emulated kernels and DeviceKV
    read KV_VRAM_SLACK alike): a rejected row's cell overwrites one a later row reads from the ring
    and the tokens part from plain greedy's. So the slack is what keeps them."""
    import strata.backends.cuda.memory as memory
    from strata.engine.llm import LLM
    plain = LLM(device="cuda")
    monkeypatch.setattr(memory, "KV_VRAM_SLACK", 0)
    spec = LLM(device="cuda", mtp=True, spec=3, kv_resident=RESIDENT)
    assert spec.runner.kv.vram_ring_cells == RESIDENT
    pairs = [greedy_with_changing_windows(spec, plain, p) for p in SPEC_PROMPTS]
    assert any(got != want for got, want in pairs)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")     # the garbage's NaNs
@pytest.mark.parametrize("fmt", ["f16", "q4_0"])
def test_parallel_slots_each_read_their_own_window(fake, rng, fmt):
    check_parallel_windows(open_pack(DEMO), rng, fmt, RESIDENT)


def test_parallel_requests_over_windows_equal_all_resident(fake):
    """Requests side by side in --parallel 2 slots over --kv-resident windows, one of them sharing the
    other's prefix (its cells copied between the slots' host cells, then its window refilled): each
    request's tokens and log-probabilities those of the same slots all in VRAM."""
    from strata import LLM
    from strata.config import SamplingParams
    from strata.engine.scheduler import Request
    system = "You are a careful coding agent with tools to read and write files. " * 3
    prompts = [system + "List the files.", system + "Run the tests.", "Write one line about the sea."]
    out = []
    for kw in ({}, {"kv_resident": RESIDENT}):
        llm = LLM(device="cuda", parallel=2, max_context=160, **kw)
        reqs = [llm.scheduler.submit(Request(llm.tokenizer.encode(p), SamplingParams(max_tokens=12, logprobs=1)))
                for p in prompts]
        for r in reqs:
            assert list(llm.scheduler.drive(r))[-1][0] == "done"
        out.append([(r.completion.token_ids, [e.logprob for e in r.completion.logprobs]) for r in reqs])
        shared = llm.status()["kept_conversations"]["shared_prefixes"]
    assert out[0] == out[1] and shared >= 1

