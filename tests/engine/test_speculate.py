"""MTP speculative decoding on the CPU: verify rows equal one-row steps bit for bit, greedy output
with --spec 1..4 equals plain greedy, rollback leaves no stale cell readable, and speculative
sampling keeps the target's distribution (strata/engine/speculate.py)."""
import math

import numpy as np
import pytest

from strata import LLM
from strata.config import SamplingParams
from strata.engine.speculate import accept
from strata.errors import InvalidArgument

PROMPTS = ["Once upon a time", "The little robot wanted", "def add(a, b):"]


@pytest.fixture(scope="module")
def demo():
    return LLM(device="cpu")


@pytest.fixture(scope="module")
def demo_spec():
    return LLM(device="cpu", mtp=True, spec=4)


def test_verify_window_rows_equal_one_row_steps_bitwise(demo, rng):
    """A window of T rows at n..n+T-1 gives, row by row, the logits and hidden states (and the K/V)
    of T one-row steps over the same tokens: the property greedy identity rests on."""
    runner = demo.runner
    prompt = demo.tokenizer.encode(PROMPTS[1])
    for T in (2, 3, 5, 8):
        toks = rng.integers(0, demo.args.vocab_size, T).tolist()
        runner.reset()
        runner.prefill(prompt, 0, logits=False)
        n = len(prompt)
        logits, hidden = runner.verify(toks, n)
        window_kv = [runner.kv.read(layer, n + T)[0].copy() for layer in range(demo.args.num_hidden_layers)]
        runner.reset()
        runner.prefill(prompt, 0, logits=False)
        for i, t in enumerate(toks):
            one, h = runner.step_model.forward(np.asarray([t]), np.asarray([n + i]), runner.kv)
            assert np.array_equal(one[0], logits[i]) and np.array_equal(h[0], hidden[i]), f"T={T} row {i}"
            runner.cached_ids.append(t)
        for layer, k in enumerate(window_kv):
            assert np.array_equal(runner.kv.read(layer, n + T)[0], k)
    runner.reset()


def test_one_row_step_is_the_plain_decode_step(demo):
    """RowOps with one row is CpuOps itself: the decode step the engine always ran."""
    runner = demo.runner
    ids = demo.tokenizer.encode(PROMPTS[0])
    runner.reset()
    runner.prefill(ids[:-1], 0, logits=False)
    kv_copy = runner.kv
    a, _ = runner.step_model.forward(np.asarray(ids[-1:]), np.asarray([len(ids) - 1]), kv_copy)
    runner.reset()
    runner.prefill(ids[:-1], 0, logits=False)
    b, _ = runner.model.forward(np.asarray(ids[-1:]), np.asarray([len(ids) - 1]), runner.kv)
    assert np.array_equal(a, b)
    runner.reset()


def test_greedy_with_spec_1_to_4_equals_plain(demo, demo_spec):
    """64 greedy tokens per prompt, identical with 1..4 drafts a window and without."""
    runner = demo_spec.runner
    for prompt in PROMPTS:
        want = demo.generate(prompt, max_tokens=64)
        for n in (1, 2, 3, 4):
            runner.spec = n
            runner.reset()
            got = demo_spec.generate(prompt, max_tokens=64)
            assert got.token_ids == want.token_ids, f"--spec {n} on {prompt!r}"
            assert got.finish_reason == want.finish_reason
            assert got.timings.draft_n > 0 and 0 < got.timings.draft_n_accepted <= got.timings.draft_n
    runner.spec = 4
    st = demo_spec.status()["speculation"]
    assert st["draft_n"] > 0 and 0 < st["acceptance"] <= 1 and 1 < st["tokens_per_verify"] <= 5


def test_prefix_reuse_and_rollback_keep_greedy_identical(demo, demo_spec):
    """A second request on the first's cached prefix (the drafter's pending states reused), and
    a continuation, still give plain greedy's tokens; every cell past the sequence is NaN or unwritten."""
    runner = demo_spec.runner
    runner.spec = 3
    runner.reset()
    first = demo_spec.generate(PROMPTS[2], max_tokens=40)
    n = len(runner.cached_ids)
    L = demo_spec.args.num_hidden_layers
    for layer in range(L + 1):
        k = runner.kv.read(layer, runner.kv.cells[layer])[0]     # every cell held, decoded
        for cell in (k[n:] if layer < L else k[runner.drafter.done:]):   # rolled back (NaN) or never written
            assert np.isnan(cell).all() or not cell.any(), f"layer {layer}: a stale cell holds values"
    ids = demo_spec.tokenizer.encode(PROMPTS[2])
    again = demo_spec.generate(ids, max_tokens=40)
    assert again.usage.cached_tokens > 0 and again.token_ids == first.token_ids
    more = ids + first.token_ids[:20]
    cont = demo_spec.generate(more, max_tokens=30)
    assert cont.usage.cached_tokens > len(ids)
    assert cont.token_ids == demo.generate(more, max_tokens=30).token_ids
    runner.spec = 4


def test_spec_flags_are_checked(demo):
    with pytest.raises(InvalidArgument, match="needs --mtp"):
        LLM(device="cpu", spec=2)
    with pytest.raises(InvalidArgument, match="--mtp drafts only under --spec"):
        LLM(device="cpu", mtp=True)
    with pytest.raises(InvalidArgument, match="at most 7"):
        LLM(device="cpu", mtp=True, spec=8)


def _chi2_sf(x: float, dof: int) -> float:
    """P(chi-square with dof degrees of freedom > x): 1 - the regularized lower gamma P(dof/2, x/2),
    by its power series (no scipy here)."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    term = total = 1.0 / a
    n = 0
    while term > 1e-17 * total:
        n += 1
        term *= z / (a + n)
        total += term
    return max(0.0, 1.0 - math.exp(-z + a * math.log(z) - math.lgamma(a)) * total)


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square goodness of fit, bins with expected count < 5 merged into one."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return _chi2_sf(stat, int(keep.sum()) - 1)


def test_accept_rule_emits_the_target_distribution(rng):
    """The first token a window emits is distributed as the target's p whatever the drafter's q:
    accept d ~ q with min(1, p/q), else draw from (p - q)+. 20000 windows over 6 tokens; the test
    fails by chance with probability 1e-4. A rule that always accepts fails it (checked too)."""
    V, M = 6, 20000
    params = SamplingParams(temperature=1.0)
    p_logits = rng.normal(0, 1.5, (2, V)).astype(np.float32)
    q_logits = rng.normal(0, 1.5, V).astype(np.float32)
    from strata.engine.sampler import choose, probs_host
    p0, q = probs_host(p_logits[0], params), probs_host(q_logits, params)
    counts, biased = np.zeros(V), np.zeros(V)
    for _ in range(M):
        d = choose(q, rng.random())
        a, tok = accept(p_logits, [d], [q], params, rng.random)
        counts[d if a == 1 else tok] += 1
        biased[d] += 1
    assert _chi2_pvalue(counts, p0) > 1e-4
    assert np.abs(q - p0).sum() < 0.2 or _chi2_pvalue(biased, p0) < 1e-4


class MarkovTarget:
    """A target whose next-token logits depend on the last token only (P [V, V] for the main model,
    Q for the drafter): speculative_step's whole loop (chained drafts, acceptance, residual, extra
    token) over exactly known distributions, fast enough for thousands of windows."""

    def __init__(self, P, Q):
        from types import SimpleNamespace
        self.logP, self.logQ = np.log(P), np.log(Q)
        self.args = SimpleNamespace(num_hidden_layers=1)
        self.cached_ids = [0]

    def verify(self, ids, start):
        return self.logP[ids], np.zeros((len(ids), 1), np.float32)

    def mtp(self, hidden, next_ids, positions, logits_rows=slice(None)):
        return self.logQ[next_ids][logits_rows], np.zeros((len(next_ids), 1), np.float32)

    def forget(self, layers, start, stop):
        pass


def test_speculative_sampling_keeps_a_markov_chains_distribution(rng):
    """The 3 tokens of one window of 2 drafts after token 0, 6000 windows over a 5-token chain whose
    drafter disagrees with it, against the chain's exact 3-token distribution; chance failure 1e-4."""
    from strata.engine.speculate import MtpDrafter, SpecStats, speculative_step
    V = 5
    P = rng.dirichlet(np.ones(V), V)
    Q = rng.dirichlet(np.ones(V), V)
    params = SamplingParams(temperature=1.0)
    counts = {}
    stats = SpecStats()
    for _ in range(6000):
        target, drafter = MarkovTarget(P, Q), MtpDrafter()
        drafter.extend(np.zeros((1, 1), np.float32))
        out, token = [], 0
        while len(out) < 3:
            out += speculative_step(target, drafter, stats, token, 2 - len(out), params, rng.random)
            token = out[-1]
        counts[tuple(out[:3])] = counts.get(tuple(out[:3]), 0) + 1
    keys = [(a, b, c) for a in range(V) for b in range(V) for c in range(V)]
    exact = np.asarray([P[0, a] * P[a, b] * P[b, c] for a, b, c in keys])
    assert _chi2_pvalue(np.asarray([counts.get(k, 0) for k in keys], float), exact) > 1e-4
    assert 0.1 < stats.draft_n_accepted / stats.draft_n < 0.9


def test_sampled_tokens_keep_the_distribution_and_the_seed(tmp_path, rng):
    """Tokens 1-3 of sampled generations (temperature 1, top-k 4) under --spec 2, where tokens 2 and
    3 come from a verify window of 2 drafts, against the exact joint distribution plain sampling
    has (from the model's logits): 250 seeds on a tiny random MTP model (whose drafts are mostly
    rejected: the residual path); chance failure 1e-4. The same seed gives the same tokens twice."""
    pytest.importorskip("torch")
    from tests.fixtures import SHAPES, make_pack
    pack, _ = make_pack(tmp_path, SHAPES["mtp"], seed=int(rng.integers(1 << 16)))
    plain, spec = LLM(pack, device="cpu"), LLM(pack, device="cpu", mtp=True, spec=2)
    params = dict(temperature=1.0, top_k=4)
    sp = SamplingParams(**params)
    prompt = rng.integers(0, 300, 7).tolist()
    from strata.engine.sampler import probs_host

    def dist(ids):
        p = probs_host(plain.logits(ids)[-1], sp)
        return {int(t): p[t] for t in np.flatnonzero(p)}
    eos = set(plain.tokenizer.eos_token_ids)
    joint = {}

    def walk(seq, prob):                 # every 3-token continuation, or a shorter one ended by an EOS (-1)
        if len(seq) == 3 or (seq and seq[-1] == -1):
            joint[tuple(seq)] = joint.get(tuple(seq), 0.0) + prob
            return
        for t, p in dist(prompt + seq).items():
            walk(seq + [-1 if t in eos else t], prob * p)
    walk([], 1.0)
    keys = sorted(joint)
    counts = np.zeros(len(keys))
    for seed in range(250):             # 4 tokens, so the first window holds 2 drafts
        out = spec.generate(prompt, max_tokens=4, seed=seed, **params)
        seq = out.token_ids[:3] + ([-1] if out.finish_reason == "stop" and len(out.token_ids) < 3 else [])
        counts[keys.index(tuple(seq))] += 1
    st = spec.status()["speculation"]
    assert st["draft_n"] > st["verify_passes"]
    assert _chi2_pvalue(counts, np.asarray([joint[k] for k in keys])) > 1e-4
    a = spec.generate(prompt, max_tokens=12, seed=123, **params).token_ids
    b = spec.generate(prompt, max_tokens=12, seed=123, **params).token_ids
    assert a == b


def _simulate(auto, cost_ms, alpha, windows, rng):
    """auto over `windows` windows of a drafter whose drafts each pass with probability alpha and
    windows of n drafts taking cost_ms(n) -> tokens per ms."""
    tokens = ms = 0.0
    for _ in range(windows):
        n = auto.choose()
        a = 0
        while a < n and rng.random() < alpha:
            a += 1
        t = cost_ms(n) * rng.uniform(0.95, 1.05)
        auto.observe(n, a, t)
        tokens, ms = tokens + a + 1, ms + t
    return tokens / ms


def test_spec_auto_never_slower_than_plain_and_close_to_the_best(rng):
    """--spec auto's rule over random step costs and acceptance rates, 6000 windows each: within 2%
    of plain decoding's rate at worst (its once-per-runner climb and rare probe windows), within
    10% of the best fixed N; drafting off where a window costs rows like the CPU's, on where it is
    nearly flat."""
    from strata.engine.speculate import AutoDrafts
    for trial in range(25):
        alpha = rng.uniform(0.0, 0.95)
        base, per_row, per_draft = rng.uniform(5, 50), rng.uniform(0.0, 1.2), rng.uniform(0.0, 0.4)

        def cost(n):
            return base * (1 + per_row * n) + base * per_draft * n
        auto = AutoDrafts(4)
        rate = _simulate(auto, cost, alpha, 6000, rng)
        expected = {n: (1 - alpha ** (n + 1)) / (1 - alpha) / cost(n) for n in range(5)}
        assert rate >= 0.98 * expected[0], (trial, alpha, per_row, per_draft, auto.to_dict())
        assert rate >= 0.9 * max(expected.values()), (trial, alpha, per_row, per_draft, auto.to_dict())
    cpu_like = AutoDrafts(4)
    _simulate(cpu_like, lambda n: 30.0 * (n + 1) + 5 * n, 0.7, 200, rng)
    gpu_like = AutoDrafts(4)
    _simulate(gpu_like, lambda n: 10.0 + 0.5 * n + 1.0 * n, 0.8, 200, rng)
    assert cpu_like.n == 0 and gpu_like.n >= 2


def test_spec_auto_keeps_greedy_identical(demo):
    """Windows whose N --spec auto changes between them still give plain greedy's tokens."""
    llm = LLM(device="cpu", mtp=True, spec="auto")
    want = demo.generate(PROMPTS[0], max_tokens=48).token_ids
    assert llm.generate(PROMPTS[0], max_tokens=48).token_ids == want
    auto = llm.status()["speculation"]["auto"]
    assert {0, 1} <= set(auto["window_ms"]) and 0 < auto["alpha"] < 1


def test_prompt_chunks_fill_the_draft_layers_kv(demo_spec):
    """Read in chunks of 5, a 23-token prompt leaves the MTP layer's cells 0..21 as the draft layer
    over the whole prompt's hidden states computes them (batched per chunk, so within float
    rounding), and one pending state (position 22) for the first decode step's draft."""
    from strata.backends.cpu import KVCache
    runner, a = demo_spec.runner, demo_spec.args
    ids = (demo_spec.tokenizer.encode(PROMPTS[0] + " " + PROMPTS[1] + " " + PROMPTS[2]) * 3)[:23]
    assert len(ids) == 23
    runner.reset()
    chunk, runner.prefill_chunk = runner.prefill_chunk, 5
    try:
        runner.prefill(ids, 0, logits=False)
    finally:
        runner.prefill_chunk = chunk
    assert runner.drafter.done == 22 and runner.drafter.pending.shape == (1, a.hidden_size)
    kv = KVCache(a.num_hidden_layers + 1, a.num_key_value_heads, a.head_dim, 64)
    _, hidden = runner.model.forward(np.asarray(ids), np.arange(23), kv)
    runner.model.mtp_forward(hidden[:-1], np.asarray(ids[1:]), np.arange(22), kv)
    L = a.num_hidden_layers
    np.testing.assert_allclose(runner.kv.read(L, 22)[0], kv.read(L, 22)[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(runner.drafter.pending[0], hidden[-1], rtol=1e-4, atol=1e-5)
    runner.reset()


def test_a_prompt_diverging_inside_the_drafted_text_rewrites_the_draft_layers_cell(demo_spec):
    """After a request, a prompt that leaves the cached sequence inside its final draft-layer cells
    re-reads one more token, so cell n-1 is recomputed with the new next token: the MTP layer's K/V
    then equals that of the new prompt read from scratch."""
    from strata.backends.cpu import KVCache
    runner, a = demo_spec.runner, demo_spec.args
    runner.spec = 2
    runner.reset()
    ids = demo_spec.tokenizer.encode(PROMPTS[1])
    first = demo_spec.generate(ids, max_tokens=24).token_ids
    cut = len(ids) + 10
    assert cut < runner.drafter.done
    other = (ids + first)[:cut] + [t + 1 for t in (ids + first)[cut:cut + 3]]
    n = runner.reusable_prefix(other)
    assert n == cut - 1
    runner.prefill(other, n, logits=False)
    kv = KVCache(a.num_hidden_layers + 1, a.num_key_value_heads, a.head_dim, 64)
    _, hidden = runner.model.forward(np.asarray(other), np.arange(len(other)), kv)
    runner.model.mtp_forward(hidden[:-1], np.asarray(other[1:]), np.arange(len(other) - 1), kv)
    L = a.num_hidden_layers
    np.testing.assert_allclose(runner.kv.read(L, len(other) - 1)[0], kv.read(L, len(other) - 1)[0],
                               rtol=1e-4, atol=1e-5)
    runner.spec = 4
    runner.reset()
