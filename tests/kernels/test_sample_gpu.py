"""strata_sample_f32 (cuda/sample.cu) against sample_reference, and the reference against the engine's
Sampler. Device and reference agree on every draw not within 1e-5 of a boundary (the device's expf
may differ from numpy's by an ulp or two; sample_margins says how close each draw fell)."""

import numpy as np
import pytest

from strata.backends.cuda.sample import launch_shape, sample_reference
from strata.config import SamplingParams
from strata.engine.sampler import Sampler

NEAR = 1e-5   # draws whose u or top_p fall this close to a boundary may go either way


def _params(rng, B, V):
    T = rng.choice([0.0, 0.3, 0.7, 1.0, 1.5], B).astype(np.float32)
    k = rng.choice([0, 1, 2, 20, 50, 1024, V + 3], B).astype(np.int32)
    p = rng.choice([1.0, 0.95, 0.8, 0.5, 1e-6], B).astype(np.float32)
    return T, k, p, rng.random(B)


# ---- CPU: the reference against strata/engine/sampler.py -----------------------------------------

@pytest.mark.parametrize("V", [7, 500, 4093])
def test_reference_matches_sampler_given_the_same_draw(rng, V):
    checked = 0
    for _ in range(60):
        logits = (rng.standard_normal(V) * rng.choice([0.5, 3.0, 8.0])).astype(np.float32)
        T = float(rng.choice([0.0, 0.5, 1.0, 2.0]))
        k = int(rng.choice([0, 1, 3, 20, V]))
        p = float(rng.choice([1.0, 0.9, 0.5, 0.05]))
        seed = int(rng.integers(1 << 30))
        u = np.random.default_rng(seed).random()     # Sampler's choice draws exactly this double
        want = Sampler(SamplingParams(temperature=T, top_k=k, top_p=p, seed=seed))(logits)
        tok, _, margin = sample_reference(logits[None], T, k, p, u, margins=True)
        if margin[0] > 1e-4:                          # the sampler works in float64
            assert tok[0] == want, (T, k, p, u)
            checked += 1
    assert checked > 40


def test_reference_keeps_every_tie_of_the_kth_value_and_breaks_ties_by_id():
    logits = np.array([1.0, 3.0, 2.0, 3.0, 2.0, 2.0, -np.inf], np.float32)
    # top_k = 2 keeps both 3.0s; p tiny keeps only the lower id of them
    for u in np.linspace(0, 0.999, 7):
        assert sample_reference(logits[None], 1.0, 2, 1e-6, u)[0][0] == 1
    toks = {int(sample_reference(logits[None], 1.0, 3, 1.0, u)[0][0]) for u in np.linspace(0, 0.999, 50)}
    assert toks == {1, 2, 3, 4, 5}          # the 3rd value (2.0) is tied three times: all kept
    assert sample_reference(logits[None], 0.0, 0, 1.0, 0.5)[0][0] == 1   # greedy: lowest id of the max


def test_reference_probabilities_and_draw_rule():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    # p = 0.7: {0, 1} renormalized to 0.625 / 0.375; ids in order along u
    assert sample_reference(logits[None], 1.0, 0, 0.7, 0.6)[0][0] == 0
    tok, prob = sample_reference(logits[None], 1.0, 0, 0.7, 0.63)
    assert tok[0] == 1 and abs(prob[0] - 0.375) < 1e-6


def test_launch_shape():
    assert launch_shape(3) == ((3, 1, 1), (1024, 1, 1))


# ---- GPU: the kernel against the reference -------------------------------------------------------

@pytest.fixture(scope="module")
def sampler():
    from strata.backends.cuda.sample import CudaSampler

    return CudaSampler()


def _check(sampler, logits, T, k, p, u):
    tok, prob = sampler.sample(logits, T, k, p, u)
    want, want_prob, margin = sample_reference(logits, T, k, p, u, margins=True)
    sure = margin > NEAR
    np.testing.assert_array_equal(tok[sure], want[sure])
    np.testing.assert_allclose(prob[sure], want_prob[sure], rtol=1e-5)
    assert np.all((tok >= 0) & (tok < logits.shape[1]))
    again = sampler.sample(logits, T, k, p, u)
    np.testing.assert_array_equal(again[0], tok)     # deterministic
    np.testing.assert_array_equal(again[1], prob)
    return int(sure.sum())


@pytest.mark.gpu
@pytest.mark.parametrize("V", [1, 5, 1000, 4093, 32000, 151936, 151937])
def test_sample_random(sampler, rng, V):
    checked = rows = 0
    for _ in range(6):
        B = int(rng.integers(1, 9))
        logits = (rng.standard_normal((B, V)) * rng.choice([1.0, 4.0, 10.0])).astype(np.float32)
        checked += _check(sampler, logits, *_params(rng, B, V))
        rows += B
    assert checked >= 0.8 * rows      # near-boundary draws are rare; most rows must be compared


@pytest.mark.gpu
@pytest.mark.parametrize("V", [4093, 151936])
def test_sample_k1_is_argmax_and_p_tiny_is_argmax(sampler, rng, V):
    logits = (rng.standard_normal((8, V)) * 3).astype(np.float32)
    u = rng.random(8)
    np.testing.assert_array_equal(sampler.sample(logits, 1.0, 1, 1.0, u)[0], np.argmax(logits, 1))
    np.testing.assert_array_equal(sampler.sample(logits, 0.7, 0, 1e-7, u)[0], np.argmax(logits, 1))
    np.testing.assert_array_equal(sampler.sample(logits, 0.0, 5, 0.5, u)[0], np.argmax(logits, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("V", [1000, 151936])
def test_sample_ties_and_minus_inf(sampler, rng, V):
    logits = rng.integers(0, 6, (8, V)).astype(np.float32)   # every value tied thousands of times
    logits[1, rng.random(V) < 0.5] = -np.inf
    logits[2, :] = -np.inf
    logits[2, rng.integers(0, V, 3)] = 1.0
    logits[3, rng.integers(0, V, 5)] = np.nan
    T, k, p, u = _params(rng, 8, V)
    _check(sampler, logits, T, k, p, u)
    for kk in (1, 2, 10, 3000):       # k lands inside a tie group, kept set past the shared memory
        _check(sampler, logits, 1.0, kk, rng.choice([1.0, 0.9, 0.3], 8), rng.random(8))


@pytest.mark.gpu
def test_sample_flat_distribution_nucleus_covers_most_of_the_row(sampler, rng):
    V = 151936
    logits = (rng.standard_normal((4, V)) * 0.01).astype(np.float32)
    _check(sampler, logits, 1.0, 0, np.float32([0.95, 0.5, 1.0, 0.999]), rng.random(4))
    _check(sampler, logits, 2.0, 100000, 0.9, rng.random(4))


@pytest.mark.gpu
def test_sample_u_extremes(sampler, rng):
    V = 151936
    logits = (rng.standard_normal((4, V)) * 5).astype(np.float32)
    for u in (0.0, np.nextafter(1.0, 0.0)):
        _check(sampler, logits, 1.0, 50, 0.9, u)
        _check(sampler, logits, 0.8, 0, 1.0, u)


def test_fake_sample_emulation_matches_the_reference(rng):
    from tests.engine import fake_cuda, fake_sample

    B, V = 3, 777
    logits = rng.standard_normal((B, V)).astype(np.float32)
    T, k, p, u = _params(rng, B, V)
    dev = fake_cuda.Device(0)
    bufs = []
    for a in (logits, T, k, p, u, np.zeros(B, np.int32), np.zeros(B, np.float32)):
        buf = fake_cuda.DeviceBuffer(dev, a.nbytes)
        buf.copy_from_host(np.ascontiguousarray(a))
        bufs.append(buf)
    grid, block = launch_shape(B)
    fake_sample.check_block(block)
    fake_sample.emulate_sample(grid, *(b.ptr for b in bufs), V)
    tok, prob = np.empty(B, np.int32), np.empty(B, np.float32)
    bufs[5].copy_to_host(tok)
    bufs[6].copy_to_host(prob)
    want = sample_reference(logits, T, k, p, u)
    np.testing.assert_array_equal(tok, want[0])
    np.testing.assert_array_equal(prob, want[1])
