"""strata_gemv_<qtype> and strata_gemv_batch_<qtype> (cuda/gemv.cu) through CudaOps against float64.

Reference: W dequantized by strata.quant.dequant (bit-exact with gguf.quants), then W @ x in float64.
Tolerance: ||y - ref|| / ||ref|| < 1e-5. The kernels accumulate in float32, and for low-bit types
sum x * (1 + q / 2^b) per scale group before subtracting sum x, which costs a few ulp of that sum;
measured errors on an H200 are at most 1.2e-6. The norm runs over at least MIN_OUTPUTS outputs: a
matrix of few rows is multiplied with several fresh x, since a single dot product of random data
can be near zero, and then no relative error of it is meaningful. Outputs are poisoned with NaN
before each launch, so a row the kernel skips fails.
"""

import numpy as np
import pytest

from strata.quant import QTYPES
from strata.quant.dequant import dequantize
from strata.quant.random import random_qtensor_bytes
from tests.quant.test_dequant import F16_FIELDS, extreme_blocks

pytestmark = pytest.mark.gpu

RTOL = 1e-5
MIN_OUTPUTS = 64
PRODUCTION_SHAPES = [(2048, 768), (768, 2048), (4096, 2048)]


def awkward_shapes(name):
    bs = QTYPES[name].block_size
    if bs == 1:  # n % 8 != 0 takes the one-weight path, n % 8 == 0 the 16-byte one
        return [(1, 1), (1, 7), (3, 33), (7, 257), (13, 96), (5, 4099), (1, 8)]
    return [(1, bs), (1, 7 * bs), (13, bs), (7, 2 * bs), (97, 3 * bs), (31, 5 * bs)]


def rel_err(y, ref) -> float:
    return float(np.linalg.norm(y.astype(np.float64) - ref) / np.linalg.norm(ref))


def check_gemv(ops, rng, name, data, shape, batch=None, split=False):
    rows, n = shape
    w64 = dequantize(name, data, shape).astype(np.float64)
    ys, refs = [], []
    for _ in range(-(-MIN_OUTPUTS // (rows * (batch or 1)))):
        x = rng.standard_normal((batch, n) if batch else n).astype(np.float32)
        y = ops.gemv(name, data, shape, x, split=split)
        assert y.shape == (*x.shape[:-1], rows) and np.isfinite(y).all()
        ys.append(y.reshape(-1))
        refs.append((x.astype(np.float64) @ w64.T).reshape(-1))
    err = rel_err(np.concatenate(ys), np.concatenate(refs))
    assert err < RTOL, f"{name} {shape} batch {batch}: rel err {err:.2e}"


@pytest.fixture(scope="module")
def ops():
    from strata.backends.cuda.testing import CudaOps

    return CudaOps()


@pytest.mark.parametrize("name", list(QTYPES))
def test_gemv_matches_float64(ops, rng, name):
    for shape in awkward_shapes(name) + PRODUCTION_SHAPES:
        data = random_qtensor_bytes(name, shape, rng, std=float(rng.uniform(1e-3, 1.0)))
        check_gemv(ops, rng, name, data, shape)


@pytest.mark.parametrize("name", list(QTYPES))
def test_gemv_split_matches_float64(ops, rng, name):
    """strata_gemv_split_<qtype>: the units of a row over 4 warps (few-row matrices: an attention
    output projection 2048 x 4096, a router 128 x 2048)."""
    for shape in awkward_shapes(name) + PRODUCTION_SHAPES + [(2048, 4096), (128, 2048)]:
        data = random_qtensor_bytes(name, shape, rng, std=float(rng.uniform(1e-3, 1.0)))
        check_gemv(ops, rng, name, data, shape, split=True)


def test_gemv_split_is_deterministic(ops, rng):
    data = random_qtensor_bytes("Q8_0", (2048, 4096), rng)
    x = rng.standard_normal(4096).astype(np.float32)
    first = ops.gemv("Q8_0", data, (2048, 4096), x, split=True)
    assert all(np.array_equal(first, ops.gemv("Q8_0", data, (2048, 4096), x, split=True)) for _ in range(3))


@pytest.mark.parametrize("name", list(F16_FIELDS))
def test_gemv_extreme_scales(ops, rng, name):
    shape = (37, 3 * QTYPES[name].block_size)
    check_gemv(ops, rng, name, extreme_blocks(name, 37 * 3, rng), shape)


@pytest.mark.parametrize("name", list(QTYPES))
def test_gemv_batch_matches_float64(ops, rng, name):
    bs = QTYPES[name].block_size
    shapes = [(1, 8), (13, 5), (7, 96)] if bs == 1 else [(1, bs), (13, 3 * bs)]
    for shape, batch in zip(shapes + [(768, 2048)], (1, 3, 8, 5)):
        data = random_qtensor_bytes(name, shape, rng)
        check_gemv(ops, rng, name, data, shape, batch=batch)


@pytest.mark.parametrize("name,batch", [("Q4_K", None), ("Q8_0", None), ("Q6_K", 4), ("F16", None), ("BF16", 8)])
def test_gemv_into_writes_only_its_rows(ops, rng, name, batch):
    """W at a 16-byte offset in a bigger buffer, rows not a multiple of a block's rows: y's neighbours
    stay poisoned."""
    rt, qt = ops._rt, QTYPES[name]
    rows, n = 13, 2 * max(qt.block_size, 64)
    data = random_qtensor_bytes(name, (rows, n), rng)
    x = rng.standard_normal((batch or 1, n)).astype(np.float32)
    w_dev = rt.DeviceBuffer(ops.device, data.size + 32)
    w_dev.copy_from_host(data, offset=16)
    x_dev = ops._upload(x)
    y_bytes = (batch or 1) * rows * 4
    y_dev = rt.DeviceBuffer(ops.device, y_bytes + 40)
    y_dev.fill_bytes(0xFF)
    ops.gemv_into(name, w_dev.ptr + 16, x_dev, y_dev.ptr + 20, rows, n, batch=batch)
    back = np.empty(y_bytes + 40, np.uint8)
    y_dev.copy_to_host(back, ops.stream)
    ops.stream.synchronize()
    assert (back[:20] == 0xFF).all() and (back[20 + y_bytes:] == 0xFF).all()
    ref = x.astype(np.float64) @ dequantize(name, data, (rows, n)).astype(np.float64).T
    assert rel_err(back[20:20 + y_bytes].view(np.float32).reshape(ref.shape), ref) < RTOL


def test_gemv_rejects_bad_input(ops, rng):
    from strata.errors import InvalidArgument

    data = random_qtensor_bytes("Q8_0", (4, 64), rng)
    with pytest.raises(InvalidArgument, match=r"x \(32,\)"):
        ops.gemv("Q8_0", data, (4, 64), np.ones(32, np.float32))
    with pytest.raises(InvalidArgument, match="B <= 8"):
        ops.gemv("Q8_0", data, (4, 64), np.ones((9, 64), np.float32))
    with pytest.raises(InvalidArgument, match="batch 9"):
        ops.gemv_into("Q8_0", 0x1000, 0x2000, 0x3000, 4, 64, batch=9)
    with pytest.raises(InvalidArgument, match="w at 0x1004 is not 16-byte aligned"):
        ops.gemv_into("Q8_0", 0x1004, 0x2000, 0x3000, 4, 64)
