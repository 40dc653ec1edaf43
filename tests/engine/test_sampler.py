import numpy as np
import pytest

from strata.config import SamplingParams
from strata.engine.sampler import Sampler
from strata.errors import InvalidArgument


def test_greedy_is_argmax():
    logits = np.random.default_rng().normal(size=1000).astype(np.float32)
    assert Sampler(SamplingParams())(logits) == int(np.argmax(logits))


def test_seed_reproducible_and_top_k_respected():
    logits = np.random.default_rng().normal(size=500).astype(np.float32)
    p = SamplingParams(temperature=1.0, top_k=5, seed=7)
    a = [Sampler(p)(logits) for _ in range(3)]
    s = Sampler(p)
    draws = {s(logits) for _ in range(300)}
    assert a[0] == a[1] == a[2]
    assert draws <= set(np.argsort(-logits)[:5].tolist()) and len(draws) > 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=1))
    assert {s(logits) for _ in range(300)} == {0, 1}


@pytest.mark.parametrize("kw", [{"max_tokens": -1}, {"temperature": -0.5}, {"top_p": 0.0}, {"top_p": 1.5},
                                {"top_k": -2}, {"stop": [""]}])
def test_bad_sampling_params(kw):
    with pytest.raises(InvalidArgument):
        SamplingParams(**kw)


def test_pick_host_equals_numpy_choice_on_the_same_draws(rng):
    """pick_host's draw rule is numpy's Generator.choice: same seed, same tokens."""
    logits = rng.standard_normal(300).astype(np.float32)       # flat enough that 200 draws vary
    p = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=int(rng.integers(1 << 30)))
    z = logits.astype(np.float64) / p.temperature
    kth = np.partition(z, -p.top_k)[-p.top_k]
    probs = np.exp(np.where(z < kth, -np.inf, z) - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = order[: int(np.searchsorted(np.cumsum(probs[order]), p.top_p)) + 1]
    masked = np.zeros_like(probs)
    masked[keep] = probs[keep]
    ref = np.random.default_rng(p.seed)
    want = [int(ref.choice(300, p=masked / masked.sum())) for _ in range(200)]
    s = Sampler(p)
    assert [s(logits) for _ in range(200)] == want
    assert len(set(want)) > 3


def test_nucleus_equals_the_whole_rows_stable_sort():
    """sampler.nucleus orders only the likeliest NUCLEUS_FIRST ids (and their ties) when they reach
    top_p: the set must be the whole row's stable sort's, ties and flat rows included."""
    import numpy as np

    from strata.engine import sampler

    def whole(probs, top_p):
        order = np.argsort(-probs, kind="stable")
        return order[: int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1]

    rng = np.random.default_rng(1)
    for trial in range(200):
        V = int(rng.choice([5, 1000, 1025, 5000, 151936]))
        x = (rng.standard_normal(V) * rng.choice([0.1, 1, 3, 10])).astype(np.float32)
        if trial % 3 == 0:
            x = np.round(x, 1)          # many ties
        if trial % 7 == 0:
            x[:] = 0                    # a flat row: every id ties
        z = x.astype(np.float64)
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        top_p = float(rng.choice([0.05, 0.5, 0.9, 0.999, 0.99999]))
        assert np.array_equal(sampler.nucleus(probs, top_p), whole(probs, top_p)), (trial, V, top_p)
