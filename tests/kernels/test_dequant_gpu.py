"""strata_dequant_<qtype> (cuda/dequant.cu) through CudaOps against strata.quant.dequant: bit for bit.

Tolerance: none. Every float32 must equal the numpy reference (itself bit-exact with gguf.quants).
Inputs: random valid blocks (strata.quant.random) with a random std, over awkward shapes (1 row,
primes, several blocks per row) and the production sizes; for the types with f16 scale fields also
uniformly random bytes with extreme-but-finite scales (subnormals to 65504, as
tests/quant/test_dequant.py makes them); for F16 and BF16 every bit pattern. Outputs are poisoned
with 0xFF bytes (NaN) before each launch, so an element the kernel skips fails the comparison.
"""

import numpy as np
import pytest

from strata.quant import QTYPES
from strata.quant.dequant import dequantize
from strata.quant.random import random_qtensor_bytes
from tests.quant.test_dequant import F16_FIELDS, extreme_blocks

pytestmark = pytest.mark.gpu

PRODUCTION_SHAPES = [(2048, 768), (768, 2048), (4096, 2048)]


def awkward_shapes(name):
    bs = QTYPES[name].block_size
    if bs == 1:
        return [(1, 1), (7, 5), (3, 2, 97), (1, 4099), (13, 8)]
    return [(1, bs), (1, 5 * bs), (13, bs), (7, 2 * bs), (2, 3, 3 * bs), (31, 7 * bs)]


def assert_same_bits(got, want):
    assert got.dtype == np.float32 and got.shape == want.shape
    diff = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert diff.size == 0, (f"{diff.size} of {got.size} differ; first at flat index {diff[0]}: "
                            f"{got.reshape(-1)[diff[0]]!r} != {want.reshape(-1)[diff[0]]!r}")


@pytest.fixture(scope="module")
def ops():
    from strata.backends.cuda.testing import CudaOps

    return CudaOps()


@pytest.mark.parametrize("name", list(QTYPES))
def test_dequant_bit_exact(ops, rng, name):
    for shape in awkward_shapes(name) + PRODUCTION_SHAPES:
        data = random_qtensor_bytes(name, shape, rng, std=float(rng.uniform(1e-3, 1.0)))
        assert_same_bits(ops.dequantize(name, data, shape), dequantize(name, data, shape))


@pytest.mark.parametrize("name", list(F16_FIELDS))
def test_dequant_extreme_scales_bit_exact(ops, rng, name):
    shape = (37, 3 * QTYPES[name].block_size)
    data = extreme_blocks(name, 37 * 3, rng)
    got = ops.dequantize(name, data, shape)
    assert np.isfinite(got).all()
    assert_same_bits(got, dequantize(name, data, shape))


@pytest.mark.parametrize("name", ["F16", "BF16"])
def test_dequant_every_16_bit_pattern(ops, rng, name):
    bits = rng.permutation(np.arange(1 << 16, dtype=np.uint32).astype(np.uint16))
    if name == "F16":  # NaN payloads are not compared; infinities and subnormals are
        bits = bits[((bits & 0x7C00) != 0x7C00) | ((bits & 0x03FF) == 0)]
    data = bits.view(np.uint8)
    assert_same_bits(ops.dequantize(name, data, (bits.size,)), dequantize(name, data, (bits.size,)))


@pytest.mark.parametrize("name", ["Q6_K", "Q8_0", "IQ4_NL", "F16"])
def test_dequant_into_writes_only_its_range(ops, rng, name):
    """Blocks and output inside bigger buffers at 16-byte offsets: the bytes around stay poisoned."""
    rt, qt = ops._rt, QTYPES[name]
    shape = (5, 3 * max(qt.block_size, 8))
    data = random_qtensor_bytes(name, shape, rng)
    count = shape[0] * shape[1]
    src = rt.DeviceBuffer(ops.device, data.size + 64)
    src.copy_from_host(data, offset=48)
    out = rt.DeviceBuffer(ops.device, count * 4 + 64)
    out.fill_bytes(0xFF)
    ops.dequantize_into(name, src.ptr + 48, out.ptr + 32, data.size // qt.type_size)
    back = np.empty(count * 4 + 64, np.uint8)
    out.copy_to_host(back, ops.stream)
    ops.stream.synchronize()
    assert (back[:32] == 0xFF).all() and (back[32 + count * 4:] == 0xFF).all()
    assert_same_bits(back[32:32 + count * 4].view(np.float32).reshape(shape), dequantize(name, data, shape))


def test_dequant_rejects_bad_input(ops, rng):
    from strata.errors import FormatError, InvalidArgument, UnsupportedError

    data = random_qtensor_bytes("Q4_K", (2, 256), rng)
    with pytest.raises(FormatError, match=r"Q4_K.*288 bytes.*\(3, 256\)"):
        ops.dequantize("Q4_K", data, (3, 256))
    with pytest.raises(UnsupportedError, match="block size"):
        ops.dequantize("Q4_K", data, (1, 576))
    with pytest.raises(InvalidArgument, match="uint8"):
        ops.dequantize("Q4_K", data.view(np.int8), (2, 256))
    with pytest.raises(InvalidArgument, match="16-byte aligned"):
        ops.dequantize_into("Q4_K", 0x1008, 0x2000, 1)


def f16_bits_equal(got, want):
    diff = np.flatnonzero(got.view(np.uint16) != want.view(np.uint16))
    assert diff.size == 0, f"{diff.size} of {got.size} halves differ; first at {diff[0]}: {got.reshape(-1)[diff[0]]!r}"


@pytest.mark.parametrize("name", list(QTYPES))
def test_dequant_h_is_f16_of_the_exact_weights(ops, rng, name):
    """strata_dequant_h_<q> (tma-gemm's dense weights): each weight the f16 rounding (nearest even)
    of the exact float32 one, bit for bit; nothing written past its count (poison kept)."""
    qt = QTYPES[name]
    for shape in awkward_shapes(name)[:3] + [(768, 2048)]:
        if qt.block_size > 1 and int(np.prod(shape)) % 8:
            continue
        data = random_qtensor_bytes(name, shape, rng, std=float(rng.uniform(1e-3, 1.0)))
        n = int(np.prod(shape))
        n_blocks = n // qt.block_size
        out = ops._output(2 * n + 64)
        work = n_blocks if qt.block_size == 1 else n_blocks * (qt.block_size // 8)
        src = ops._upload(data)         # held until the download's synchronize
        ops._launch("dequant_h", max(1, min(-(-work // 256), 1 << 20)), (src, out, n_blocks), qtype=name)
        got = ops._download(out, (n + 32,), np.float16)
        f16_bits_equal(got[:n], dequantize(name, data, shape).astype(np.float16).reshape(-1))
        assert (got[n:].view(np.uint16) == 0xFFFF).all()


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0"])
def test_dequant_h_groups_writes_each_blob_and_skips_null_ones(ops, rng, name):
    """strata_dequant_h_groups_<q> (a layer's experts for tma-gemm): group g's matrix at
    ptrs[g] + part_offset to out + g * stride halves, a null address skipped (its rows keep their
    poison), the rows past each matrix untouched."""
    qt = QTYPES[name]
    rows, n, part = 24, 2 * max(qt.block_size, 256), 4096
    stride = rows * n + 64
    mats = [random_qtensor_bytes(name, (rows, n), rng) for _ in range(3)]
    blobs = [ops._upload(np.concatenate([rng.integers(0, 256, part, dtype=np.uint8), m])) for m in mats]
    ptrs = ops._upload(np.array([blobs[0].ptr, 0, blobs[2].ptr, blobs[1].ptr], np.uint64))
    out = ops._output(2 * 4 * stride)
    n_blocks = rows * n // qt.block_size
    ops._launch("dequant_h_groups", (3, 4), (ptrs, part, n_blocks, out, stride), qtype=name)
    got = ops._download(out, (4, stride), np.float16)
    for g, m in ((0, mats[0]), (2, mats[2]), (3, mats[1])):
        f16_bits_equal(got[g, :rows * n], dequantize(name, m, (rows, n)).astype(np.float16).reshape(-1))
    assert (got[1].view(np.uint16) == 0xFFFF).all() and (got[:, rows * n:].view(np.uint16) == 0xFFFF).all()
