"""Checks of MTP speculation on qwen3next shared by the CPU, the emulated GPU and the device tests
(tests/engine/test_qwen3next_spec.py, tests/engine/test_qwen3next_gpu.py): a runner driven token by
token (no stop at EOS: tiny random models emit it early), drafts forced to the plain continuation so
windows keep 0..N of them, and a window's rows against one-row steps."""
import numpy as np

from strata.config import SamplingParams

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


def check_spec_is_plain_greedy(plain, spec, prompt: list[int], n: int, wrong: list[int],
                                before_spec=lambda: None) -> tuple[list[int], int]:
    """plain's n greedy tokens after prompt; then spec's with --spec 1..4, and with --spec 3 and drafts
    forced to that continuation (forced_drafts' `wrong`), each the same tokens. before_spec() runs
    between plain's run and spec's. -> (the tokens, drafts kept under the forced ones)."""
    plain.reset()
    want = generate(plain, prompt, n)
    before_spec()
    for k in (1, 2, 3, 4):
        spec.spec = k
        spec.reset()
        assert generate(spec, prompt, n) == want, f"--spec {k}"
    spec.spec = 3
    spec.reset()
    kept = spec.spec_stats.draft_n_accepted
    forced_drafts(spec, prompt + want, wrong)
    assert generate(spec, prompt, n) == want
    del spec.drafter.draft
    return want, spec.spec_stats.draft_n_accepted - kept


def replay_plain(plain, prompt: list[int], full: list[int], upto: int) -> None:
    """plain reset, then prompt prefilled and full[len(prompt):upto] decoded a step each, no pick
    between (the states spec's should hold after `upto` cached tokens)."""
    plain.reset()
    plain.prefill(prompt, 0, logits=False)
    for t in full[len(prompt):upto]:
        plain.decode(t, logits=False)


def check_window_rows(runner, prompt: list[int], toks: list[int], atol: float) -> None:
    """A verify window over toks after the prompt, rolled back whole, then toks as one-row windows:
    each row's logits and the states after the last row agree within atol (0: bit for bit)."""
    runner.reset()
    runner.prefill(prompt, 0, logits=False)
    start, L = len(prompt), runner.args.num_hidden_layers
    window, _ = runner.verify(toks, start)
    after = states_of(runner)
    runner.forget(range(L), start, start + len(toks))
    rows = [runner.verify([t], start + i)[0][0] for i, t in enumerate(toks)]
    np.testing.assert_allclose(np.stack(rows), window, rtol=0, atol=atol * np.abs(window).max())
    np.testing.assert_allclose(states_of(runner), after, rtol=0, atol=atol * np.abs(after).max())


def states_of(runner) -> np.ndarray:
    """Every DeltaNet layer's states, flat f32 (a CPU or a GPU runner)."""
    kv = runner.kv
    if hasattr(kv, "read_states"):
        return kv.read_states().view(np.float32).copy()
    return np.concatenate([np.concatenate([kv.conv[l].ravel(), kv.ssm[l].ravel()]) for l in kv.layers])
