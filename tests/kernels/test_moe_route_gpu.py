"""strata_moe_route_f32 (cuda/moe_route.cu) against strata.backends.cpu.moe_route.

Ids: exact equality (order included). Weights, f32: rel 1e-6; expf is within 2 ulp of numpy's exp
and the sums round differently, a few ulp (~3e-7) in all.
"""

import numpy as np
import pytest

from strata.backends.cpu import moe_route

pytestmark = pytest.mark.gpu

# (T, E, A): one expert, primes, Qwen3-30B-A3B (128 experts, top 8), Qwen3-Next class (512, top 10),
# E not a multiple of the warp, a prompt chunk
CASES = [(1, 1, 1), (1, 128, 8), (3, 7, 3), (7, 128, 8), (13, 60, 4), (5, 257, 10), (33, 512, 10),
         (2, 32, 32), (512, 128, 8)]


@pytest.fixture(scope="module")
def ops():
    from strata.backends.cuda.testing import CudaOps

    return CudaOps()


def check(ops, logits, top_k, norm):
    ids, weights = ops.moe_route(logits, top_k, norm)
    ref_ids, ref_weights = moe_route(logits, top_k, norm)
    assert ids.dtype == np.int32 and weights.dtype == np.float32
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_weights, rtol=1e-6, atol=0)


@pytest.mark.parametrize("T,E,A", CASES)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "raw"])
def test_moe_route_random_logits(ops, rng, T, E, A, norm):
    check(ops, (rng.standard_normal((T, E)) * 2).astype(np.float32), A, norm)


@pytest.mark.parametrize("T,E,A", [(9, 128, 8), (4, 512, 10), (3, 33, 5)])
def test_moe_route_ties_go_to_the_lower_id(ops, rng, T, E, A):
    # few distinct logits: equal logits give bit-equal probabilities on both sides
    check(ops, rng.integers(-2, 3, (T, E)).astype(np.float32), A, True)
