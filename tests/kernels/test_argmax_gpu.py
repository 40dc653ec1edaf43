"""strata_argmax_f32 (cuda/argmax.cu) against numpy's argmax: exact indices, ties to the lowest."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

# (B, V): 1, primes, V not a multiple of 4 (the scalar path), the Qwen3 vocabulary 151936
SHAPES = [(1, 1), (1, 7), (3, 1000), (5, 4093), (1, 151936), (4, 151936), (2, 151937), (16, 32000)]


@pytest.fixture(scope="module")
def ops():
    from strata.backends.cuda.testing import CudaOps

    return CudaOps()


@pytest.mark.parametrize("B,V", SHAPES)
def test_argmax_random(ops, rng, B, V):
    x = (rng.standard_normal((B, V)) * 5).astype(np.float32)
    out = ops.argmax(x)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, np.argmax(x, axis=1))


@pytest.mark.parametrize("B,V", [(3, 1000), (2, 151936), (2, 151937)])
def test_argmax_ties_go_to_the_lowest_index(ops, rng, B, V):
    x = rng.integers(0, 4, (B, V)).astype(np.float32)  # every row holds its maximum many times
    np.testing.assert_array_equal(ops.argmax(x), np.argmax(x, axis=1))


def test_argmax_special_values(ops, rng):
    V = 151936
    x = rng.standard_normal((4, V)).astype(np.float32)
    x[0, :] = -np.inf                                  # all -inf: index 0
    x[1, rng.integers(0, V, 3)] = np.inf               # +inf beats everything, first one wins
    x[2, [V - 1, 70000, 90000]] = np.nan                # numpy: the first NaN wins
    x[3, V - 1] = 1e30                                 # the very last element
    np.testing.assert_array_equal(ops.argmax(x), np.argmax(x, axis=1))
