"""strata_mask_logits_f32 (cuda/mask_logits.cu) against strata.engine.sampler.mask_logits (numpy):
exact, over awkward vocabulary sizes and random bitmasks (all-allowed and all-refused rows too)."""

import numpy as np
import pytest

from strata.engine.sampler import mask_logits

pytestmark = pytest.mark.gpu

# (B, V): 1, primes, V not a multiple of 32 (a partial last word), the Qwen3 vocabulary 151936
SHAPES = [(1, 1), (1, 31), (2, 33), (3, 1000), (5, 4093), (1, 8192), (4, 151936), (2, 151937)]


@pytest.fixture(scope="module")
def ops():
    from strata.backends.cuda.testing import CudaOps

    return CudaOps()


@pytest.mark.parametrize("B,V", SHAPES)
def test_mask_logits_random(ops, rng, B, V):
    x = rng.standard_normal((B, V)).astype(np.float32)
    m = rng.integers(-2**31, 2**31, (B, (V + 31) // 32), dtype=np.int64).astype(np.int32)
    m[0] = -1 if B > 1 else m[0]          # every token allowed
    if B > 2:
        m[1] = 0                           # none allowed: the whole row is -inf
    got = ops.mask_logits(x, m)
    want = np.stack([mask_logits(x[b], m[b]) for b in range(B)])
    np.testing.assert_array_equal(got, want)
