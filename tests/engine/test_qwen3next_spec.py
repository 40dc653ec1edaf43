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
from tests.fixtures_qwen3next import NEXT_SHAPES, make_next_pack  # noqa: E402


@pytest.fixture(scope="module")
def pack_path(tmp_path_factory):
    path, _ = make_next_pack(tmp_path_factory.mktemp("next-mtp"), NEXT_SHAPES["tiny"], seed=21, mtp=True)
    return path


GREEDY = SamplingParams()


def forced_drafts(runner, full: list[int], wrong: list[int]):
    """Make runner's drafter propose the plain greedy continuation `full` (prompt + tokens), with the
    draft at index wrong[w % len(wrong)] of window w changed (-1: none), so windows keep 0..N drafts.
    The drafter's own bookkeeping (its cells, pending rows) still runs: only the proposals change."""
    real, windows = runner.drafter.draft, []

    def draft(target, token, n, params, draw):
        drafts, qs = real(target, token, n, params, draw)
        at = len(target.cached_ids) + 1
        drafts = [full[at + k] if at + k < len(full) else 0 for k in range(n)]
        k = wrong[len(windows) % len(wrong)]
        if 0 <= k < n:
            drafts[k] = (drafts[k] + 1) % target.args.vocab_size
        windows.append(k)
        return drafts, qs
    runner.drafter.draft = draft


class Draws:
    """The sampler's draw() from a seeded generator."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def draw(self) -> float:
        return float(self.rng.random())


def generate(runner, ids: list[int], n: int, params=GREEDY, seed: int = 0) -> list[int]:
    """n tokens after ids (read from the runner's reusable prefix; no stop at EOS), speculating where
    the runner does."""
    draws = Draws(seed)
    runner.prefill(ids, runner.reusable_prefix(ids), logits=False)
    out = [runner.pick(params, draws.draw())]
    while len(out) < n:
        if runner.spec:
            out += runner.speculate(out[-1], params, draws, n - len(out))
        else:
            runner.decode(out[-1], logits=False)
            out.append(runner.pick(params, draws.draw()))
    return out


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
        plain.reset()
        want = generate(plain, prompt, 24)
        full = prompt + want
        for n in (1, 2, 3, 4):
            spec.spec = n
            spec.reset()
            assert generate(spec, prompt, 24) == want, f"--spec {n}"
        # drafts that agree with the target: windows keep 0..N of them, each rollback from another row
        spec.spec = 3
        spec.reset()
        kept = spec.spec_stats.draft_n_accepted
        forced_drafts(spec, full, wrong=[-1, 0, 2, 1, -1])
        assert generate(spec, prompt, 24) == want
        del spec.drafter.draft
        assert spec.spec_stats.draft_n_accepted - kept > 12
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


def test_follow_up_turns_resume_as_without_spec(pack_path, rng):
    """A turn extending the cached sequence resumes from the live states a window left; one that drops
    the answer would resume from the prompt's snapshot, but the draft layer's cell before it was
    written with the answer's first token and the main hidden state to redo it is not kept, so it
    reads from the start: both give plain greedy's tokens."""
    pack = open_pack(pack_path)
    plain, spec = CpuRunner(pack, 128, 12), CpuRunner(pack, 128, 12, spec=2)
    V = pack.args.vocab_size
    prompt = rng.integers(0, V, 11).tolist()
    first = generate(spec, prompt, 10)
    assert first == generate(plain, prompt, 10)
    follow = prompt + first + rng.integers(0, V, 4).tolist()
    dropped = prompt + rng.integers(0, V, 5).tolist()
    for turn, start in ((follow, len(spec.cached_ids)), (dropped, 0)):
        assert spec.reusable_prefix(turn) == start
        got = generate(spec, turn, 10)
        plain.reset()
        assert got == generate(plain, turn, 10)


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
