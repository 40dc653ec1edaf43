"""MTP speculation on qwen3next, on the CPU: the DeltaNet states of a verify window's rows are kept and
the last accepted row's made live (HybridCache.window_begin / window_row / forget), so greedy output
with --spec 1..4 equals plain greedy, sampled windows leave the states plain decoding would have, and
follow-up turns resume from the live states and snapshots as without speculation."""
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from strata.config import SamplingParams  # noqa: E402
from strata.engine.runner import CpuRunner  # noqa: E402
from strata.pack import open_pack  # noqa: E402
from tests.engine.next_spec_checks import (check_spec_is_plain_greedy, check_window_rows, generate,  # noqa: E402
                                         replay_plain)
from tests.fixtures_qwen3next import NEXT_SHAPES, make_next_pack  # noqa: E402


@pytest.fixture(scope="module")
def pack_path(tmp_path_factory):
    path, _ = make_next_pack(tmp_path_factory.mktemp("next-mtp"), NEXT_SHAPES["tiny"], seed=21, mtp=True)
    return path


def plain_states(pack, ids: list[int], prompt_len: int):
    """A plain runner after prefill(ids[:prompt_len]) and one decode step per token after."""
    r = CpuRunner(pack, 128, 12)
    r.prefill(ids[:prompt_len], 0, logits=False)
    for t in ids[prompt_len:]:
        r.decode(t)
    return r


def assert_same_states(a, b, what):
    for l in a.kv.layers:
        assert np.array_equal(a.kv.conv[l], b.kv.conv[l]) and np.array_equal(a.kv.ssm[l], b.kv.ssm[l]), (what, l)


def test_greedy_with_spec_1_to_4_equals_plain(pack_path, rng):
    pack = open_pack(pack_path)
    plain, spec = CpuRunner(pack, 128, 12), CpuRunner(pack, 128, 12, spec=4)
    for _ in range(2):
        prompt = rng.integers(0, pack.args.vocab_size, int(rng.integers(5, 20))).tolist()
        # --spec 1..4, then drafts forced to agree with the target: windows keep 0..N of them, each
        # rollback from another row
        want, kept = check_spec_is_plain_greedy(plain, spec, prompt, 24, wrong=[-1, 0, 2, 1, -1])
        full = prompt + want
        assert kept > 12
        n = len(spec.cached_ids)
        assert_same_states(spec, plain_states(pack, full[:n], len(prompt)), "after forced drafts")
    assert spec.spec_stats.draft_n > 0


def test_sampled_windows_leave_the_plain_states(pack_path, rng):
    """Sampled speculation (temperature 1, top-k 8) over mostly rejected drafts: after each run the
    live DeltaNet states and the next step's logits are bit for bit plain decoding's over the emitted
    tokens (the target distributions exact acceptance samples from); a seed repeats its tokens."""
    pack = open_pack(pack_path)
    spec = CpuRunner(pack, 128, 12, spec=3)
    prompt = rng.integers(0, pack.args.vocab_size, 9).tolist()
    params = SamplingParams(temperature=1.0, top_k=8)
    for seed in range(3):
        spec.reset()
        out = generate(spec, prompt, 14, params, seed)
        n = len(spec.cached_ids)
        ref = plain_states(pack, (prompt + out)[:n], len(prompt))
        assert_same_states(spec, ref, f"seed {seed}")
        t = (prompt + out)[n]
        assert np.array_equal(spec.decode(t), ref.decode(t))
    assert spec.spec_stats.draft_n > 0
    spec.reset()
    a = generate(spec, prompt, 14, params, 7)
    spec.reset()
    assert generate(spec, prompt, 14, params, 7) == a


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_follow_up_turns_resume_as_without_spec(fake, pack_path, rng, device):
    """A turn extending the cached sequence resumes from the live states a window left; one that drops
    the answer resumes from the prompt's snapshot, where the draft layer's cell before it (written with
    the answer's first token) is redone from the main hidden state kept beside the snapshot: both give
    plain greedy's tokens, and the redone cell is the one written had the answer never been drafted."""
    pack = open_pack(pack_path)
    if device == "cpu":
        plain, spec, fresh = CpuRunner(pack, 128, 12), CpuRunner(pack, 128, 12, spec=2), CpuRunner(pack, 128, 12, spec=2)
    else:
        plain, spec, fresh = gpu_runner(pack), gpu_runner(pack, "2"), gpu_runner(pack, "2")
    V, L = pack.args.vocab_size, pack.args.num_hidden_layers
    prompt = rng.integers(0, V, 11).tolist()
    first = generate(spec, prompt, 10)
    assert first == generate(plain, prompt, 10)
    follow = prompt + first + rng.integers(0, V, 4).tolist()
    dropped = prompt + rng.integers(0, V, 5).tolist()
    for turn, start in ((follow, len(spec.cached_ids)), (dropped, len(prompt))):
        assert spec.reusable_prefix(turn) == start
        got = generate(spec, turn, 10)
        plain.reset()
        assert got == generate(plain, turn, 10)
    if device == "cpu":             # the draft layer's cells: as if the answer had never been drafted
        fresh.prefill(prompt, 0, logits=False)
        fresh.prefill(dropped, len(prompt), logits=False)
        spec.reset()
        spec.prefill(prompt, 0, logits=False)
        generate(spec, prompt, 6)
        spec.prefill(dropped, spec.reusable_prefix(dropped), logits=False)
        n = len(dropped) - 1
        np.testing.assert_array_equal(spec.kv.kv.read(L, n)[0], fresh.kv.kv.read(L, n)[0])


def test_window_rows_are_one_row_steps_bit_for_bit(pack_path, rng):
    pack = open_pack(pack_path)
    r = CpuRunner(pack, 64, 12, spec=4)
    for T in (2, 5):
        check_window_rows(r, rng.integers(0, 300, 9).tolist(), rng.integers(0, 300, T).tolist(), 0.0)


def test_rollback_restores_the_states_after_the_kept_row(pack_path, rng):
    """forget on a DeltaNet layer makes live the states after `start` tokens of the last verify
    window; outside that window it refuses rather than leave wrong states."""
    pack = open_pack(pack_path)
    r = CpuRunner(pack, 64, 12, spec=2)
    ids = rng.integers(0, pack.args.vocab_size, 10).tolist()
    r.prefill(ids[:7], 0, logits=False)
    L = pack.args.num_hidden_layers
    r.verify(ids[7:], 7)
    r.forget(range(L), 8, 10)
    r.cached_ids = ids[:8]
    assert_same_states(r, plain_states(pack, ids[:8], 7), "rolled back to row 0")
    with pytest.raises(KeyError, match="verify window"):
        r.forget(r.kv.layers[:1], 3, 4)


# ---- the GPU runner over tests/engine/fake_cuda ---------------------------------------------------
def gpu_runner(pack, spec: str = "0"):
    from strata.config import EngineConfig
    from strata.engine.cuda_runner import CudaRunner
    r = CudaRunner(pack, 96, EngineConfig(device="cuda", mtp=spec != "0", spec=spec))
    r.prefill_chunk = 12            # chunks of 12 (the prompt kernels), tails of <= 8 (the step kernels)
    return r


def assert_states_close(a, b):
    """The DeltaNet states of two GPU runners, bit for bit: the emulation's T-row kernels compute each
    row as the one-row launch does (fake_cuda: gemv_rows, gemv3_rows, attention_rows), as the device's
    row-invariant kernels do (test_qwen3next_gpu.py)."""
    np.testing.assert_array_equal(a.kv.read_states().view(np.float32), b.kv.read_states().view(np.float32))


def test_greedy_with_spec_equals_plain_on_the_emulated_gpu(fake, pack_path, rng):
    """Verify windows of N + 1 rows run the DeltaNet row by row through the one-token kernels and copy
    each row's states aside; greedy with --spec 1..4 (and forced drafts that windows keep 0..3 of)
    emits plain greedy's tokens and leaves plain decoding's states, bit for bit: the device test's
    steps (test_qwen3next_gpu.py), on a device that lags the host as far as it can (fake_cuda.lagging).
    There the reference's 60-odd decode(logits=False) in a row, with no pick between, once sent later
    steps' inputs to earlier ones (the step's staging copy read the pinned buffer after the host had
    rewritten it): its states were not plain decoding's though spec's were (#15)."""
    pack = open_pack(pack_path)
    plain, spec = gpu_runner(pack), gpu_runner(pack, "4")
    V = pack.args.vocab_size
    with fake.lagging():
        for T in (2, 5):
            check_window_rows(spec, rng.integers(0, V, 15).tolist(), rng.integers(0, V, T).tolist(), 0.0)
        prompt = rng.integers(0, V, 17).tolist()
        want, kept = check_spec_is_plain_greedy(plain, spec, prompt, 40, wrong=[-1, 0, 2, 1],
                                                before_spec=fake.launches.clear)
        assert "strata_gdn_step_f32" in fake.launches and spec.spec_stats.draft_n > 0     # spec's launches only
        assert kept > 20
        replay_plain(plain, prompt, prompt + want, len(spec.cached_ids))
        assert_states_close(spec, plain)
    assert spec.device_windows == 0        # the window graphs are qwen3moe's: a hybrid's run eagerly
    assert set(spec.graphs) == {1, 2, 3, 4, 5}      # windows of every size replayed as graphs


def test_window_rows_match_one_row_steps_on_the_emulated_gpu(fake, pack_path, rng):
    """Bit for bit, as on the device (test_qwen3next_gpu.py)."""
    r = gpu_runner(open_pack(pack_path), "4")
    check_window_rows(r, rng.integers(0, 300, 9).tolist(), rng.integers(0, 300, 5).tolist(), 0.0)


def test_sampled_spec_and_follow_up_on_the_emulated_gpu(fake, pack_path, rng):
    """A sampled run leaves the states plain decoding reaches over its tokens; a follow-up turn then
    resumes from the live states and gives plain greedy's tokens."""
    pack = open_pack(pack_path)
    plain, spec = gpu_runner(pack), gpu_runner(pack, "2")
    V = pack.args.vocab_size
    prompt = rng.integers(0, V, 10).tolist()
    out = generate(spec, prompt, 12, SamplingParams(temperature=1.0, top_k=8), seed=3)
    n = len(spec.cached_ids)
    plain.prefill(prompt, 0, logits=False)
    for t in (prompt + out)[len(prompt):n]:
        plain.decode(t, logits=False)
    assert_states_close(spec, plain)
    follow = (prompt + out)[:n] + rng.integers(0, V, 3).tolist()
    assert spec.reusable_prefix(follow) == n
    got = generate(spec, follow, 10)
    plain.reset()
    assert got == generate(plain, follow, 10)


def test_the_plan_prices_the_window_states(fake, pack_path):
    """The rows a verify window keeps (the states before it and after each of its rows) are priced
    with the KV, to the byte of the runner's cache."""
    from strata.config import EngineConfig
    from strata.engine import planner
    from strata.engine.planner import PackSizes
    pack = open_pack(pack_path)
    sizes = PackSizes.from_meta(pack.meta, int(pack.meta["files"]["dense.bin"]["bytes"]))
    kv = {}
    for spec in ("0", "3"):
        cfg = EngineConfig(device="cuda", max_context=96, mtp=spec != "0", spec=spec)
        kv[spec] = planner.mandatory_items(sizes, cfg)["kv"]
        assert gpu_runner(pack, spec).kv.nbytes - kv[spec] == gpu_runner(pack).kv.nbytes - kv["0"]
    assert kv["3"] - kv["0"] == 5 * gpu_runner(pack).kv.state_bytes()


def test_streamed_experts_and_warm_up_with_spec_on_the_emulated_gpu(fake, pack_path, rng):
    """Under a small expert cache (the draft layer's experts cached for good, misses read in place,
    lent to a prompt of 12 tokens or more as ring slots: seed 001's room), after warm_up (which runs windows of every draft count), greedy with --spec 2 is plain greedy
    and warm_up left the states and snapshots as they were."""
    from strata.config import EngineConfig
    from strata.engine.cuda_runner import CudaRunner
    pack = open_pack(pack_path)
    plain = gpu_runner(pack)
    spec = CudaRunner(pack, 96, EngineConfig(device="cuda", mtp=True, spec="2", expert_cache="2", mtp_room_min=12))
    spec.prefill_chunk = 12
    assert not spec.store.resident
    prompt = rng.integers(0, pack.args.vocab_size, 15).tolist()
    spec.prefill(prompt, 0, logits=False)
    assert spec.room_lent       # seed 001: the prompt's draft-layer cells read none of its experts (mtp_cells)
    states, snapshots = spec.kv.read_states(), [n for n, _ in spec.kv.snapshots]
    spec.warm_up()
    np.testing.assert_array_equal(spec.kv.read_states(), states)
    assert [n for n, _ in spec.kv.snapshots] == snapshots and spec.cached_ids == prompt
    spec.reset()
    assert generate(spec, prompt, 16) == generate(plain, prompt, 16)
    assert spec.spec_stats.draft_n > 0


def test_llm_with_spec_generates_plain_greedy(pack_path, rng):
    from strata import LLM
    plain, spec = LLM(pack_path, device="cpu"), LLM(pack_path, device="cpu", mtp=True, spec="auto")
    for _ in range(2):
        prompt = rng.integers(0, 300, 12).tolist()
        assert spec.generate(prompt, max_tokens=16).token_ids == plain.generate(prompt, max_tokens=16).token_ids
    assert spec.status()["speculation"]["auto"] is not None      # --spec auto ran its choices


def test_draft_window_on_the_cpu_and_refused_on_the_gpu(fake, pack_path, rng):
    """--draft-window on qwen3next: on the CPU the draft layer's cells are a ring in the HybridCache's
    KVCache (greedy output stays plain greedy's); the GPU's hybrid cache has no ring yet: one line."""
    from strata.config import EngineConfig
    from strata.engine.cuda_runner import CudaRunner
    from strata.errors import InvalidArgument
    pack = open_pack(pack_path)
    plain, spec = CpuRunner(pack, 1024, 12), CpuRunner(pack, 1024, 12, spec=3, draft_window=16)
    assert spec.draft_slots and spec.kv.window(pack.args.num_hidden_layers) == 16
    prompt = rng.integers(0, pack.args.vocab_size, 30).tolist()
    assert generate(spec, prompt, 24) == generate(plain, prompt, 24)
    with pytest.raises(InvalidArgument, match="--draft-window 16: the draft layer's K/V ring of qwen3next"):
        CudaRunner(pack, 1024, EngineConfig(device="cuda", mtp=True, spec="2", draft_window=16))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_snapshot_of_an_overwritten_sequence_is_not_resumed(fake, pack_path, rng, device):
    """Prompt a (snapshot at its end), then b sharing a few tokens with it, then c sharing most of b:
    a's snapshot lies within c's common prefix with the cache but holds a's states, not b's, so the
    rewind for b drops it and c resumes from b's own states (it once resumed from a's)."""
    pack = open_pack(pack_path)
    make = (lambda: CpuRunner(pack, 128, 12)) if device == "cpu" else (lambda: gpu_runner(pack))
    V = pack.args.vocab_size
    a = rng.integers(0, V, 40).tolist()
    b = a[:5] + rng.integers(0, V, 45).tolist()
    c = b[:45] + rng.integers(0, V, 5).tolist()
    r = make()
    for ids in (a, b):
        r.prefill(ids, r.reusable_prefix(ids), logits=False)
    assert [s[0] for s in r.kv.snapshots] == [50]
    start = r.reusable_prefix(c)
    assert start == 0
    got, want = r.prefill(c, start), make().prefill(c, 0)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_parallel_slots_speculate_side_by_side(fake, tmp_path, rng, device):
    """A hybrid's slots each keep their drafter and snapshot rows (Slots.SLOT_STATE), and on the GPU
    every slot's view keeps its verify windows' states in the cache's one rows buffer: requests side
    by side in two slots (one of them not drafting: logprobs) give plain greedy's tokens, and so do
    follow-up turns that resume in their slots."""
    from strata import LLM
    from strata.config import SamplingParams
    from strata.engine.scheduler import Request
    path, _ = make_next_pack(tmp_path, dict(NEXT_SHAPES["tiny"], head_dim=64), seed=3, mtp=True)
    plain = LLM(str(path), device=device, max_context=128)
    spec = LLM(str(path), device=device, max_context=128, mtp=True, spec=3, parallel=2)
    for llm in (plain, spec):           # a random model may rank EOS first: every reply runs to max_tokens
        llm.tokenizer.eos_token_ids = []
    V = plain.args.vocab_size
    prompts = [rng.integers(0, V, n).tolist() for n in (20, 33, 9)]
    # the third shares its first token with the second: a one-token prefix no DeltaNet state resumes
    # from must not make its request take over the second's slot (it once did, for 1 seed in ~V)
    prompts[2][0] = prompts[1][0]
    kws = [{}, {"logprobs": 0}, {}]

    def side_by_side(prompts, kws):
        reqs = [spec.scheduler.submit(Request(p, SamplingParams(max_tokens=12, **kw))) for p, kw in zip(prompts, kws)]
        for r in reqs:
            assert list(spec.scheduler.drive(r))[-1][0] == "done"
        return [r.completion for r in reqs]

    def alone(p, kw):
        plain.runner.reset()
        return plain.generate(p, max_tokens=12, **kw).token_ids
    got = side_by_side(prompts, kws)
    assert [c.token_ids for c in got] == [alone(p, kw) for p, kw in zip(prompts, kws)]
    assert got[1].timings.draft_n == 0 and got[0].timings.draft_n + got[2].timings.draft_n > 0
    follow = [p + c.token_ids + [5, 6, 7] for p, c in zip(prompts[1:], got[1:])]
    again = side_by_side(follow, [{}, {}])
    assert [c.token_ids for c in again] == [alone(p, {}) for p in follow]
    assert again[1].usage.cached_tokens >= len(prompts[2])      # the last request's slot kept its turn
