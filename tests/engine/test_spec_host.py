"""strata._ext.spec_host, speculation's host loop in typed Cython, against the Python versions in
strata/engine/speculate.py (the oracle): the same (a, token) for the same draws over many seeds,
temperatures, top-k and top-p; the same --spec auto choices over thousands of random windows; the
same drafter bookkeeping over random operations; and whole speculative_step runs that emit the
same tokens with either."""
import math

import numpy as np
import pytest

from strata.config import SamplingParams
from strata.engine import speculate
from strata.engine.sampler import choose, probs_host
from strata.engine.speculate import AutoDraftsPy, DrafterRowsPy, accept_py, greedy_accept_py
from tests.engine.test_speculate import MarkovTarget

spec_host = pytest.importorskip(
    "strata._ext.spec_host",
    reason="strata._ext.spec_host is not built (setup.py build_ext needs Cython; CI's pip install -e builds it)")


def test_speculate_uses_the_extension():
    assert speculate.SPEC_HOST == "cython"
    assert speculate.AutoDrafts is spec_host.AutoDrafts
    assert issubclass(speculate.MtpDrafter, spec_host.DrafterRows)
    assert speculate.greedy_accept is spec_host.greedy_accept


def test_greedy_accept_over_picks(rng):
    for _ in range(2000):
        N = int(rng.integers(0, 8))
        picks = rng.integers(0, 5, N + 1).tolist()
        drafts = [p if rng.random() < 0.7 else int(rng.integers(0, 5)) for p in picks[:N]]
        assert spec_host.greedy_accept(drafts, picks) == greedy_accept_py(drafts, picks)


def test_greedy_accept_over_logits_rows(rng):
    """Each row's argmax as np.argmax takes it: the first of tied maxima, the first NaN, -inf rows."""
    greedy = SamplingParams()
    for trial in range(600):
        N, V = int(rng.integers(0, 8)), int(rng.choice([1, 7, 300, 8192]))
        dtype = np.float32 if trial % 3 else np.float64
        logits = rng.integers(-3, 4, (N + 1, V)).astype(dtype)     # small ints: ties everywhere
        if trial % 7 == 0:
            logits[rng.integers(0, N + 1), rng.integers(0, V)] = np.nan
        if trial % 11 == 0:
            logits[rng.integers(0, N + 1)] = -np.inf
        picks = np.argmax(logits, axis=1).tolist()
        drafts = [p if rng.random() < 0.8 else int(rng.integers(0, V)) for p in picks[:N]]
        assert spec_host.greedy_accept_rows(logits, drafts) == accept_py(logits, drafts, [None] * N, greedy, None)
    logits = rng.normal(size=(3, 50)).astype(np.float32)[:, ::2]      # strided rows
    assert spec_host.greedy_accept_rows(logits, [0, 1]) == accept_py(logits, [0, 1], [None] * 2, greedy, None)


def test_choose_is_the_samplers_bit_for_bit(rng):
    for _ in range(300):
        V = int(rng.choice([1, 2, 9, 1000, 8192]))
        p = rng.dirichlet(np.full(V, 0.3))
        p[rng.random(V) < 0.3] = 0.0
        if not p.any():
            p[0] = 1.0
        p *= rng.choice([1.0, 0.37, 3.0])                  # any positive sum
        cdf = np.cumsum(p) / np.cumsum(p)[-1]
        us = np.concatenate([rng.random(20), [0.0, np.nextafter(1.0, 0.0)], cdf[rng.integers(0, V, 5)]])
        for u in us:
            assert spec_host.choose(p, float(u)) == choose(p, float(u))


def _draws(seed):
    gen = np.random.default_rng(seed)
    return lambda: float(gen.random())


PARAMS = [SamplingParams(temperature=t, top_k=k, top_p=p)
          for t in (0.3, 0.7, 1.0, 1.6) for k in (0, 1, 4, 50) for p in (1.0, 0.9, 0.5)]


@pytest.mark.parametrize("V", [64, 8192])
def test_sampled_accept_gives_the_same_tokens_and_draws(rng, V):
    """accept_sampled vs accept_py: drafts drawn from the drafter's q near the target's p (so some
    are kept, some rejected, some windows keep all), one generator seed per window for both; the
    tokens match and both took the same number of draws (the next draw matches too)."""
    kinds = {"kept all": 0, "rejected": 0}
    for seed in range(200 if V == 64 else 40):
        params = PARAMS[seed % len(PARAMS)]
        N = 1 + seed % 7
        logits = rng.normal(0, 2.0, (N + 1, V)).astype(np.float32)
        draft_logits = logits[:N] + rng.normal(0, rng.choice([0.05, 0.5, 2.0]), (N, V)).astype(np.float32)
        qs = [probs_host(row, params) for row in draft_logits]
        drafts = [choose(q, rng.random()) for q in qs]
        py_draw, cy_draw = _draws(seed), _draws(seed)
        want = accept_py(logits, drafts, qs, params, py_draw)
        got = spec_host.accept_sampled(logits, drafts, qs, params, cy_draw, probs_host)
        assert got == want, (seed, params, N)
        assert py_draw() == cy_draw()
        kinds["kept all" if want[0] == N else "rejected"] += 1
    assert all(kinds.values()), kinds


def test_sampled_accept_residual_all_zero_falls_back_to_p(rng):
    """A rejection where q >= p everywhere (q == p: the residual is all zero) draws from p, as accept_py."""
    params = SamplingParams(temperature=1.0, top_k=3)
    logits = rng.normal(0, 1, (2, 10)).astype(np.float32)
    q = probs_host(logits[0], params)
    d = int(np.flatnonzero(q)[0])
    for seed in range(200):
        assert (spec_host.accept_sampled(logits, [d], [q], params, _draws(seed), probs_host)
                == accept_py(logits, [d], [q], params, _draws(seed)))


def test_fsum_is_math_fsum(rng):
    for _ in range(500):
        xs = (rng.lognormal(0, 3, int(rng.integers(1, 64))) * rng.choice([1e-300, 1.0, 1e300])).tolist()
        if rng.random() < 0.3:
            xs = [x * rng.choice([-1.0, 1.0]) for x in xs]
        assert spec_host.fsum(xs) == math.fsum(xs)
    assert spec_host.fsum([]) == 0.0
    assert spec_host.fsum([1e16, 1.0, 1e-16]) == math.fsum([1e16, 1.0, 1e-16])


def _same_auto(py, cy):
    assert cy.n == py.n and cy.windows == py.windows and cy.gap == py.gap and cy.next_probe == py.next_probe
    assert cy.probing == py.probing and cy.climbing == py.climbing and cy.alpha == py.alpha
    assert cy.window_ms == py.window_ms and cy.seen == py.seen
    assert cy.to_dict() == py.to_dict()


@pytest.mark.parametrize("max_n,probe,max_probe,keep", [(7, 32, 1024, 16), (4, 3, 40, 5), (1, 1, 4, 1), (3, 8, 64, 2)])
def test_auto_drafts_makes_the_python_rules_choices(rng, max_n, probe, max_probe, keep):
    """5000 windows of random costs and acceptance, whose rates drift (so the probes move the choice),
    and where the runner cuts N below the choice now and then (the end of a request): the same N
    every window, the same state after."""
    py, cy = AutoDraftsPy(max_n, probe, max_probe, keep), spec_host.AutoDrafts(max_n, probe, max_probe, keep)
    alpha, base, per_row = rng.uniform(0.2, 0.9), rng.uniform(5, 50), rng.uniform(0.05, 1.2)
    for w in range(5000):
        if w % 500 == 0:
            alpha, per_row = rng.uniform(0.0, 0.95), rng.uniform(0.0, 1.2)
        n = py.choose()
        assert cy.choose() == n, (w, py.to_dict(), cy.to_dict())
        if rng.random() < 0.05:
            n = int(rng.integers(0, n + 1))
        a = 0
        while a < n and rng.random() < alpha:
            a += 1
        ms = base * (1 + per_row * n) * rng.uniform(0.9, 1.1)
        if rng.random() < 0.01:
            ms = float(round(ms))                      # ties between N
        py.observe(n, a, ms)
        cy.observe(n, a, ms)
        if w % 97 == 0:
            _same_auto(py, cy)
    _same_auto(py, cy)
    assert {py.tokens_per_ms(n) for n in py.window_ms} == {cy.tokens_per_ms(n) for n in cy.window_ms}


def test_drafter_rows_keep_the_python_bookkeeping(rng):
    """Random extend / truncate / pending reads and writes / reusable / reset on both: the same done,
    covered, pending rows and reusable prefixes."""
    D = 4
    for trial in range(40):
        py, cy = DrafterRowsPy(), spec_host.DrafterRows()
        cached = rng.integers(0, 6, 60).tolist()
        row = 0
        for _ in range(200):
            op = rng.integers(0, 7)
            if op <= 1:
                T = int(rng.integers(0, 4))
                hidden = np.arange(row, row + T * D, dtype=np.float32).reshape(T, D)
                row += T * D
                py.extend(hidden)
                cy.extend(hidden)
                hidden[:] = -1                                   # extend copies
            elif op == 2:
                length = int(rng.integers(0, py.covered + 3))
                py.truncate(length)
                cy.truncate(length)
            elif op == 3 and py.pending is not None:                 # a draft's read: done moves on
                k = int(rng.integers(0, py.pending.shape[0] + 1))
                rest = py.pending[k:]
                py.done, py.pending = py.done + k, rest
                cy.done, cy.pending = cy.done + k, cy.pending[k:]
            elif op == 4:
                ids = cached[:int(rng.integers(0, 60))] + rng.integers(0, 6, int(rng.integers(1, 4))).tolist()
                n = int(rng.integers(0, len(ids)))                  # at least one token is read
                assert py.reusable(cached, ids, n) == cy.reusable(cached, ids, n)
            elif op == 5 and rng.random() < 0.1:
                py.reset()
                cy.reset()
            elif op == 6:
                py.pending = None if rng.random() < 0.5 else np.zeros((0, D), np.float32)
                cy.pending = None if py.pending is None else np.zeros((0, D), np.float32)
            assert py.done == cy.done and py.covered == cy.covered
            pp, cp = py.pending, cy.pending
            assert (pp is None) == (cp is None) and (pp is None or np.array_equal(pp, cp))


class _Markov(MarkovTarget):
    """test_speculate's MarkovTarget in float32 logits, with verify_next when greedy_picks:
    speculative_step's whole loop, fast."""

    def __init__(self, P, Q, greedy_picks=False):
        super().__init__(P, Q)
        self.logP, self.logQ = self.logP.astype(np.float32), self.logQ.astype(np.float32)
        if greedy_picks:
            self.verify_next = lambda ids, start: (np.argmax(self.logP[ids], axis=1).tolist(),
                                                   np.zeros((len(ids), 1), np.float32))


def _run(P, Q, params, seed, python: bool, monkeypatch, greedy_picks=False, windows=60):
    with monkeypatch.context() as m:
        if python:
            m.setattr(speculate, "accept", accept_py)
            m.setattr(speculate, "greedy_accept", greedy_accept_py)
            methods = {k: v for k, v in vars(speculate.MtpDrafter).items() if k not in ("__dict__", "__weakref__")}
            m.setattr(speculate, "MtpDrafter", type("PyDrafter", (DrafterRowsPy,), methods))
        target, drafter = _Markov(P, Q, greedy_picks), speculate.MtpDrafter()
        auto = AutoDraftsPy(4, 4, 16) if python else spec_host.AutoDrafts(4, 4, 16)
        drafter.extend(np.zeros((1, 1), np.float32))
        stats, gen, out, token = speculate.SpecStats(), np.random.default_rng(seed), [], 0
        clock = np.random.default_rng(seed + 1)
        for _ in range(windows):
            n = auto.choose()
            got = speculate.speculative_step(target, drafter, stats, token, n, params, lambda: float(gen.random()))
            auto.observe(n, len(got) - 1, float(clock.uniform(1, 2)) * (1 + n))
            out += got
            token = out[-1]
        return out, auto.to_dict(), drafter.done


@pytest.mark.parametrize("greedy_picks", [False, True])
def test_speculative_step_emits_the_same_tokens_with_either(rng, monkeypatch, greedy_picks):
    V = 40
    P = rng.dirichlet(np.full(V, 0.2), V)
    Q = 0.7 * P + 0.3 * rng.dirichlet(np.full(V, 0.2), V)
    for seed in range(12):
        params = SamplingParams() if greedy_picks or seed % 4 == 0 else PARAMS[(5 * seed) % len(PARAMS)]
        want = _run(P, Q, params, seed, True, monkeypatch, greedy_picks)
        got = _run(P, Q, params, seed, False, monkeypatch, greedy_picks)
        assert got == want, (seed, params)
