"""strata_rope_f32 (cuda/rope.cu) against strata.backends.rope, and QK-norm + RoPE as the model chains them.

Tolerance, f32: |err| <= 1e-6 * max|x| + 1e-6 * |ref|. The angle is the same f32 product on both
sides and the rotation rounds each product like numpy, so only sin/cos differ (~1 ulp each): errors
stay near 2e-7 of the row's scale. QK-norm reuses strata_rms_norm_f32 on rows [T * heads, Dh].
"""

import numpy as np
import pytest

from strata.backends import cpu, rope

pytestmark = pytest.mark.gpu

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}

# (T, heads, Dh): one token, primes, heads not a multiple of the block, the production q and k
SHAPES = [(1, 1, 2), (1, 32, 128), (3, 5, 64), (7, 4, 128), (13, 7, 62), (5, 3, 256), (128, 32, 128), (257, 4, 128)]


@pytest.fixture(scope="module")
def ops():
    from strata.backends.cuda.testing import CudaOps

    return CudaOps()


def rope_ref(x, positions, inv, scale):
    cos, sin = rope.cos_sin(positions, inv, scale)
    return rope.apply(x, cos, sin).astype(np.float32)


def assert_close(y, ref, x):
    assert y.dtype == np.float32 and y.shape == ref.shape and np.isfinite(y).all()
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6 * float(np.abs(x).max()))


@pytest.mark.parametrize("T,heads,dh", SHAPES)
@pytest.mark.parametrize("scaling", [None, YARN], ids=["plain", "yarn"])
def test_rope_matches_reference(ops, rng, T, heads, dh, scaling):
    inv, scale = rope.inv_freq(dh, 1e6, scaling, 262144)
    x = rng.standard_normal((T, heads, dh)).astype(np.float32)
    positions = np.sort(rng.integers(0, 262144, T))
    y = ops.rope(x, positions, inv.astype(np.float32), scale)
    assert_close(y, rope_ref(x, positions, inv, scale), x)


def test_rope_consecutive_positions_from_an_offset(ops, rng):
    # a prompt chunk: positions p0..p0+T-1
    inv, scale = rope.inv_freq(128, 1e6, None, 40960)
    x = rng.standard_normal((300, 4, 128)).astype(np.float32)
    positions = np.arange(4000, 4300)
    assert_close(ops.rope(x, positions, inv, scale), rope_ref(x, positions, inv, scale), x)


@pytest.mark.parametrize("T,heads", [(1, 32), (1, 4), (37, 32), (37, 4)])
def test_qk_norm_then_rope(ops, rng, T, heads):
    # strata_rms_norm_f32 over rows of Dh is the QK-norm: q [T, H, Dh] is [T * H, Dh] rows
    dh, eps = 128, 1e-6
    inv, scale = rope.inv_freq(dh, 1e6, None, 40960)
    x = (rng.standard_normal((T, heads, dh)) * rng.uniform(0.1, 10.0, (T, heads, 1))).astype(np.float32)
    w = rng.uniform(-2.0, 2.0, dh).astype(np.float32)
    positions = rng.integers(0, 40960, T)
    normed = ops.rms_norm(x, w, eps)
    np.testing.assert_allclose(normed, cpu.rms_norm(x, w, eps), rtol=1e-5, atol=0)
    y = ops.rope(normed, positions, inv, scale)
    ref = rope_ref(cpu.rms_norm(x, w, eps), positions, inv, scale)
    np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-5 * float(np.abs(ref).max()))
