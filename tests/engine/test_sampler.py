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
