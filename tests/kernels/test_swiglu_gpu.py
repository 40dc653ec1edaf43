"""strata_swiglu_f32 (cuda/swiglu.cu) against a float64 reference, separate and fused gate|up layouts.

Tolerance, f32: rel 1e-6 per element. silu is g / (1 + expf(-g)) times up: expf is within 2 ulp and
the rest are single roundings, so the error stays under ~4 ulp (2.4e-7) of each element.
"""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

RTOL = 1e-6

# (T, I): 1, primes, I below / not a multiple of the 256-thread block, the production 768 (Qwen3-30B-A3B)
SHAPES = [(1, 1), (1, 768), (3, 257), (7, 768), (13, 1000), (64, 768), (2, 12289), (512, 768)]


@pytest.fixture(scope="module")
def ops():
    from strata.backends.cuda.testing import CudaOps

    return CudaOps()


def swiglu_ref(gate, up):
    g = gate.astype(np.float64)
    return g / (1.0 + np.exp(-g)) * up.astype(np.float64)


@pytest.mark.parametrize("T,I", SHAPES)
def test_swiglu_separate(ops, rng, T, I):
    gate = (rng.standard_normal((T, I)) * 3).astype(np.float32)
    up = rng.standard_normal((T, I)).astype(np.float32)
    y = ops.swiglu(gate, up)
    assert y.shape == (T, I) and y.dtype == np.float32
    np.testing.assert_allclose(y, swiglu_ref(gate, up), rtol=RTOL, atol=0)


@pytest.mark.parametrize("T,I", SHAPES)
def test_swiglu_fused_gate_up(ops, rng, T, I):
    gate_up = (rng.standard_normal((T, 2 * I)) * 3).astype(np.float32)
    y = ops.swiglu(gate_up)
    np.testing.assert_allclose(y, swiglu_ref(gate_up[:, :I], gate_up[:, I:]), rtol=RTOL, atol=0)


def test_swiglu_extreme_gates(ops, rng):
    # exp(-g) overflows to inf for g < -88: silu must give -0, not NaN
    gate = np.concatenate([rng.uniform(-200, -80, 64), rng.uniform(80, 200, 64)]).astype(np.float32)[None]
    up = rng.standard_normal(gate.shape).astype(np.float32)
    y = ops.swiglu(gate, up)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, swiglu_ref(gate, up), rtol=RTOL, atol=1e-30)


@pytest.mark.parametrize("lo,hi", [(0, 5), (2, 3), (4, 4), (1, 5)])
def test_swiglu_rows_takes_its_rows_from_the_device(rng, lo, hi):
    """strata_swiglu_rows_f32: rows [bounds[lo], bounds[hi]) of a fused gate|up buffer, nothing else."""
    from strata.backends.cuda import _runtime

    rt = _runtime()
    dev = rt.Device(0)
    stream = rt.Stream(dev)
    kernel = rt.load_library("swiglu").kernel(dev, "strata_swiglu_rows_f32", "PPPPiiiqqq")
    I, bounds = 768, np.array([0, 3, 130, 131, 131, 400], np.int32)
    T = int(bounds[-1])
    gu = np.concatenate([(rng.standard_normal((T, I)) * 3), rng.standard_normal((T, I))], axis=1).astype(np.float32)
    d_gu, d_out, d_b = rt.DeviceBuffer(dev, gu.nbytes), rt.DeviceBuffer(dev, T * I * 4), rt.DeviceBuffer(dev, bounds.nbytes)
    d_gu.copy_from_host(gu, stream)
    d_b.copy_from_host(bounds, stream)
    d_out.fill_bytes(0xFF, stream)              # NaN: rows outside the range must stay so
    kernel.launch((-(-I // 256), 7), 256, (d_gu, d_gu.ptr + 4 * I, d_out, d_b, lo, hi, I, 2 * I, 2 * I, I), stream=stream)
    out = np.empty((T, I), np.float32)
    d_out.copy_to_host(out, stream)
    stream.synchronize()
    r0, r1 = int(bounds[lo]), int(bounds[hi])
    np.testing.assert_allclose(out[r0:r1], swiglu_ref(gu[r0:r1, :I], gu[r0:r1, I:]), rtol=RTOL, atol=0)
    assert np.isnan(out[:r0]).all() and np.isnan(out[r1:]).all()
