"""strata_rms_norm_f32 (cuda/rms_norm.cu) through CudaOps against a float64 numpy reference.

Tolerance, f32: rel 1e-5 per element. The kernel sums squares in f32 (a few ulp over n <= 12288)
and rsqrtf is within 2 ulp, so errors stay near 1e-6; every factor is a product, so the relative
bound holds for small elements too (atol 0).
"""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

RTOL = 1e-5

# 1 row, primes, n below / not a multiple of the 256-thread block and of 4 (the scalar path),
# the production sizes 2048 and 4096 (the 16-byte path), and a wide row
SHAPES = [(1, 1), (1, 7), (3, 31), (5, 257), (7, 255), (13, 1000), (17, 4093), (1, 2048), (97, 2048),
          (2, 4096), (64, 4096), (1, 8191), (11, 12288)]


def rms_norm_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w.astype(np.float64)


@pytest.fixture(scope="module")
def ops():
    from strata.backends.cuda.testing import CudaOps

    return CudaOps()


@pytest.mark.parametrize("rows,n", SHAPES)
def test_rms_norm_matches_numpy(ops, rng, rows, n):
    x = (rng.standard_normal((rows, n)) * rng.uniform(0.1, 10.0, (rows, 1))).astype(np.float32)
    w = rng.uniform(-2.0, 2.0, n).astype(np.float32)
    y = ops.rms_norm(x, w, 1e-6)
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_allclose(y, rms_norm_ref(x, w, 1e-6), rtol=RTOL, atol=0)


def test_rms_norm_leading_dims(ops, rng):
    x = rng.standard_normal((2, 3, 5, 96)).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    y = ops.rms_norm(x, w, 1e-5)
    np.testing.assert_allclose(y, rms_norm_ref(x, w, 1e-5), rtol=RTOL, atol=0)


def test_rms_norm_eps_inside_the_root(ops, rng):
    # rows of tiny values: eps dominates mean(x^2), so misplacing it shows
    x = (rng.standard_normal((4, 512)) * 1e-4).astype(np.float32)
    w = rng.standard_normal(512).astype(np.float32)
    np.testing.assert_allclose(ops.rms_norm(x, w, 1e-2), rms_norm_ref(x, w, 1e-2), rtol=RTOL, atol=0)


def test_rms_norm_rejects_mismatched_weight(ops, rng):
    from strata.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="weight shape"):
        ops.rms_norm(rng.standard_normal((2, 8)).astype(np.float32), rng.standard_normal(7).astype(np.float32), 1e-6)
