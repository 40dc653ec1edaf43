"""MTP speculation on the GPU runner's host side, over tests/engine/fake_cuda: verify windows run as
decode steps of N + 1 rows through the row-invariant kernels (strata_gemv_rows_*, gemv3_rows, split-K
decode attention with the rows of one sequence), the drafter is fed from the device's hidden states,
and greedy output equals plain greedy. The bits of the property are the GPU's: test_spec_gpu.py and
tests/kernels/test_row_invariant_gpu.py check them on a device."""
import numpy as np
import pytest

from strata.engine.llm import LLM
from strata.errors import InvalidArgument

# the second prompt's draft-layer flush is more than a step's 8 rows
PROMPTS = ["The capital of France is", "Once upon a time, in a quiet village by the sea, there lived"]


def test_greedy_with_spec_equals_plain_on_the_emulated_gpu(fake):
    plain = LLM(device="cuda")
    spec = LLM(device="cuda", mtp=True, spec=3)
    fake.launches.clear()           # graph replays launch no kernel by name: count over the whole run
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_tokens=24)
        got = spec.generate(prompt, max_tokens=24)
        assert got.token_ids == want.token_ids, prompt
        assert got.timings.draft_n > 0 and 0 <= got.timings.draft_n_accepted <= got.timings.draft_n
    used = set(fake.launches)
    assert any(n.startswith("strata_gemv_rows_") for n in used)
    assert any(n.startswith("strata_gemv3_rows_") for n in used)
    assert not any(n.startswith("strata_gemv_batch_") for n in used)   # the non-invariant body is gone
    st = spec.status()["speculation"]
    assert st["draft_n"] > 0 and st["verify_passes"] > 0
    # every window but none ran as the device's window graph (strata.engine.cuda_window), captured once
    assert st["device_windows"] == st["verify_passes"]
    assert "spec3" in spec.runner.steps.graphs


def test_greedy_with_spec_equals_plain_across_the_tensor_core_threshold(fake):
    """Rows of tc_from cells and more take the tensor cores' f16 decode kernel, shorter ones
    attention.cu's, each row by its own length: windows straddling the threshold (both kernels, each
    writing its own rows' partials) give plain greedy's tokens, and the graphs of each rule are apart."""
    plain = LLM(device="cuda")
    spec = LLM(device="cuda", mtp=True, spec=3)
    plain.runner.ops.tc_from = spec.runner.ops.tc_from = 14
    fake.launches.clear()
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_tokens=24)
        got = spec.generate(prompt, max_tokens=24)
        assert got.token_ids == want.token_ids, prompt
    assert {"strata_attention_decode_f16_d64_g2", "strata_attention_decode_tc_f16_d64_g2"} <= set(fake.launches)
    keys = set(spec.runner.steps.graphs)
    assert any(str(k).endswith("+tc") for k in keys) and any(str(k).startswith("spec") for k in keys)


def test_device_windows_change_n_and_fall_back_after_plain_steps(fake):
    """Windows of changing draft counts (as --spec auto runs them: a graph per N) between plain
    steps, after which the drafter's pending rows can outnumber the next window's rows: that window
    takes the eager draft, the rest the device's window; every token is plain greedy's."""
    from strata.config import SamplingParams

    class Draws:
        def draw(self):
            return 0.5

    plain = LLM(device="cuda")
    spec = LLM(device="cuda", mtp=True, spec=3)
    r, greedy = spec.runner, SamplingParams()
    for prompt in PROMPTS:
        ids = spec.tokenizer.encode(prompt)
        want = plain.generate(ids, max_tokens=40).token_ids
        r.reset()
        r.prefill(ids, 0, logits=False)
        got = [r.pick(greedy, 0.5)]
        for k, n in enumerate([0, 0, 0, 1, 3, 2, 0, 2, 1, 3, 3, 2, 1] * 3):
            if len(got) >= 40:
                break
            r.spec = n
            got += r.speculate(got[-1], greedy, Draws(), 40 - len(got))
        assert got[:40] == want, prompt
    st = spec.status()["speculation"]
    assert 0 < st["device_windows"] < st["verify_passes"]
    assert {"spec1", "spec2", "spec3"} <= set(r.steps.graphs)


def test_verify_rows_match_one_row_steps_on_the_emulated_gpu(fake):
    llm = LLM(device="cuda", mtp=True, spec=2)
    r = llm.runner
    ids = llm.tokenizer.encode(PROMPTS[0])
    r.prefill(ids, 0)
    start = len(r.cached_ids)
    window, hidden = r.verify([5, 6, 7, 8], start)
    assert window.shape == (4, llm.args.vocab_size) and hidden.shape == (4, llm.args.hidden_size)
    r.forget(range(llm.args.num_hidden_layers), start, start + 4)
    rows = [r.verify([t], start + i)[0][0] for i, t in enumerate([5, 6, 7, 8])]
    np.testing.assert_allclose(window, np.stack(rows), rtol=0, atol=1e-4 * np.abs(window).max())


def test_spec_refused_where_the_gpu_does_not_run_it_yet(fake):
    with pytest.raises(InvalidArgument, match="staged"):
        LLM(device="cuda", mtp=True, spec=2, expert_cache="20", decode_misses="staged")


@pytest.mark.parametrize("cfg", [dict(expert_cache="20"), dict(expert_cache="20", kv="int8"), dict(kv="q4_0"),
                                 dict(expert_cache="20", prefill="24")])
def test_greedy_with_spec_equals_plain_streamed_and_quantized(fake, cfg):
    """Speculation with experts streaming (a cache of 20 slots, misses read in place, the verify rows'
    routing to the admissions) and over quantized K/V: plain greedy's tokens. The draft layer's
    experts stay cached for good (the store's fixed layer), and with prompt chunks of 24 tokens
    its prompt cells come through a chunk plan of its own inside the loan."""
    plain = LLM(device="cuda", **cfg)
    spec = LLM(device="cuda", mtp=True, spec=3, **cfg)
    store = spec.runner.store
    L, E = spec.args.num_hidden_layers, spec.args.num_experts
    if not store.resident:
        assert store.fixed_layers == (L,) and (store.slot_of[L] >= 0).all()
        assert sorted(store.slot_of[L].tolist()) == list(range(E))          # slots 0..E-1, its own
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_tokens=32)
        got = spec.generate(prompt, max_tokens=32)
        assert got.token_ids == want.token_ids, (cfg, prompt)
    st = spec.status()["speculation"]
    assert st["device_windows"] > 0
    if not store.resident:
        assert (store.slot_of[L] >= 0).all() and store.stats.misses > 0     # streamed, and still cached


def test_greedy_with_spec_equals_plain_with_a_prompt_loan(fake):
    """A budget just over the plan's mandatory bytes: prompts borrow the cache's tail (ring and pool),
    and the draft layer's prompt rows run in a step's pieces from the decode pool meanwhile (the
    loan's pool is priced for the main chunk alone); tokens are plain greedy's."""
    from strata.config import EngineConfig
    from strata.engine.cuda_runner import CudaRunner
    from strata.pack import open_pack
    from strata.engine.llm import demo_model_path
    pack = open_pack(demo_model_path())
    mandatory = CudaRunner(pack, 256, EngineConfig(device="cuda", prefill="24", mtp=True, spec="3")).plan.mandatory_bytes
    cfg = dict(vram_budget_gib=(mandatory + 15_000_000) / 2**30, prefill="24", max_context=256)
    plain = LLM(device="cuda", **cfg)
    spec = LLM(device="cuda", mtp=True, spec=3, **cfg)
    store = spec.runner.store
    assert not store.resident and store.kept_slots < store.cache_slots          # a loan, not a fixed ring
    for prompt in PROMPTS:
        want = plain.generate(prompt, max_tokens=24)
        got = spec.generate(prompt, max_tokens=24)
        assert got.token_ids == want.token_ids, prompt
    assert spec.status()["speculation"]["device_windows"] > 0


@pytest.mark.parametrize("kv", ["f16", "q4_0"])
def test_draft_cells_alone_are_the_draft_layers_cells(fake, rng, kv):
    """mtp_cells (the draft layer's K/V alone: no attention, routed experts or head) writes bit for
    bit the cells the whole draft layer writes, at a prompt chunk's size and at a step's."""
    llm = LLM(device="cuda", mtp=True, spec=2, kv=kv)
    r, a = llm.runner, llm.args
    L = a.num_hidden_layers

    def cells(n):
        out, _ = r._cells_out(n)            # every layer's planes of cells 0..n-1, layer by layer
        per_layer = len(out) // r.kv.num_layers
        return out[L * per_layer:(L + 1) * per_layer]

    for T in (5, 37):
        hidden = rng.standard_normal((T, a.hidden_size)).astype(np.float32)
        ids = rng.integers(0, a.vocab_size, T)
        r.mtp(hidden, ids, np.arange(T), logits_rows=None)
        whole = cells(T)
        for buf, off, nbytes in r._kv_ranges(T):       # poison, then the cells alone
            buf.copy_from_host(np.full(nbytes, 0x7F, np.uint8), r.stream, off)
        r.mtp_cells(hidden, ids, np.arange(T))
        for x, y in zip(whole, cells(T)):
            assert np.array_equal(x, y), (kv, T)


def test_cpu_draft_cells_alone_are_the_draft_layers_cells(rng):
    from strata.engine.runner import CpuRunner
    from strata.pack import open_pack
    from strata.engine.llm import demo_model_path
    pack = open_pack(demo_model_path())
    a = pack.args
    r = CpuRunner(pack, 64)
    hidden = rng.standard_normal((9, a.hidden_size)).astype(np.float32)
    ids = rng.integers(0, a.vocab_size, 9)
    r.mtp(hidden, ids, np.arange(9), logits_rows=None)
    whole = [np.array(p, copy=True) for p in r.kv.read(a.num_hidden_layers, 9)]
    r.kv.forget(a.num_hidden_layers, 0, 9)
    r.mtp_cells(hidden, ids, np.arange(9))
    for x, y in zip(whole, r.kv.read(a.num_hidden_layers, 9)):
        assert np.array_equal(x, y)


def test_the_draft_layers_room_leaves_the_logits_and_tokens_as_they_were(fake):
    """Seed 001: a prompt reading at least --mtp-room-min tokens lends the draft layer's cached
    experts to the prompt's ring (more ring slots, in place) and gets them back before decoding:
    prompt logits bitwise those without the room, the same greedy tokens, the experts' slots
    holding their blobs again; a shorter continuation takes no room."""
    from strata.config import EngineConfig
    from strata.engine.cuda_runner import CudaRunner
    from strata.pack import open_pack
    from strata.engine.llm import demo_model_path
    pack = open_pack(demo_model_path())
    base = dict(device="cuda", prefill="24", mtp=True, spec="3", expert_cache="20")
    plain = CudaRunner(pack, 256, EngineConfig(**base))
    roomy = CudaRunner(pack, 256, EngineConfig(**base, mtp_room_min=30))
    store, L, E = roomy.store, pack.args.num_hidden_layers, pack.args.num_experts
    assert store.ring_slots > 0 and store.fixed_slots == E
    rng = np.random.default_rng(7)
    ids = rng.integers(0, pack.args.vocab_size, 60).tolist()
    ring_before = store.ring_slots
    want, got = plain.prefill(ids, 0), roomy.prefill(ids, 0)
    assert np.array_equal(want, got)
    assert roomy.room_lent and store.stats.room_lends == 1 and store.ring_slots == ring_before
    assert sorted(store.slot_of[L].tolist()) == list(range(E))              # back in slots 0..E-1
    blobs = np.memmap(store.path, np.uint8, mode="r")
    held = np.empty(store.slots.nbytes, np.uint8)
    store.slots.copy_to_host(held, roomy.stream)
    for e in range(E):
        n, off = int(store._blob[L]), int(store._offsets[L, e])
        slot = int(store.slot_of[L, e])
        assert np.array_equal(held[slot * store.slot_bytes:slot * store.slot_bytes + n], blobs[off:off + n])
    from strata.config import SamplingParams

    class Draws:
        def draw(self):
            return 0.5

    def spec_tokens(r, k=24):
        out = [r.pick(SamplingParams(), 0.5)]
        while len(out) < k:
            out += r.speculate(out[-1], SamplingParams(), Draws(), k - len(out))
        return out[:k]
    assert spec_tokens(plain) == spec_tokens(roomy)
    more = ids + rng.integers(0, pack.args.vocab_size, 10).tolist()       # a short continuation
    n = roomy.reusable_prefix(more)
    assert len(more) - n < 30
    assert np.array_equal(plain.prefill(more, plain.reusable_prefix(more)), roomy.prefill(more, n))
    assert not roomy.room_lent and store.stats.room_lends == 1
    assert roomy.status()["speculation"]["room_lends"] == 1


@pytest.mark.parametrize("n", [1, 3, 7])
def test_the_plan_prices_each_window_graph(fake, n):
    """planner.spec_window_bytes bounds the pool a greedy window of n drafts allocates (its graph's
    reserve), from above and within a factor of two."""
    from strata.engine import planner
    from strata.engine.planner import PackSizes
    llm = LLM(device="cuda", mtp=True, spec=n, max_context=256)
    r = llm.runner
    llm.generate("The capital of France is", max_tokens=12)
    assert f"spec{n}" in r.steps.step_bytes
    used = r.steps.step_bytes[f"spec{n}"]
    sizes = PackSizes.from_meta(llm.pack.meta, llm.pack.meta["files"]["dense.bin"]["bytes"])
    priced = planner.spec_window_bytes(sizes, n, r.max_context, r.ops.num_sms, "f16")
    assert used <= priced <= 2 * used + (1 << 20), (used, priced)
