"""Our dequantizers against gguf-py's, bit for bit, over awkward shapes and extreme scales."""
import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from strata.errors import FormatError, InvalidArgument, UnsupportedError
from strata.quant import QTYPES, QTensor, tensor_bytes
from strata.quant import dequant
from strata.quant.dequant import dequantize, dequantize_rows, unpack_k4_scales
from strata.quant.random import pack_k4_scales, random_qtensor_bytes

# byte offsets of every f16 scale field in a block
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,),
}
EXTREME_F16 = np.array([65504.0, -65504.0, 6e-8, -6e-8, 6.104e-5, 0.0, -0.0, 1.0, 3e-3],
                       dtype=np.float16)


def reference(name, data, shape):
    """gguf-py's dequantization of flat bytes, reshaped to `shape`."""
    rows = data.reshape(-1, tensor_bytes(name, (1, shape[-1])))
    out = gguf_dequantize(rows, gguf.GGMLQuantizationType(QTYPES[name].ggml_id))
    return np.asarray(out, dtype=np.float32).reshape(shape)


def assert_same_bits(got, want):
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def awkward_shapes(name):
    bs = QTYPES[name].block_size
    if bs == 1:
        return [(1, 1), (7, 5), (3, 2, 96), (1, 4099)]
    return [(1, bs), (1, 5 * bs), (7, 2 * bs), (13, bs), (2, 3, 3 * bs)]


def extreme_blocks(name, num_blocks, rng):
    """Uniform random bytes (every sub-scale bit pattern) with f16 scales from random finite bit
    patterns (subnormals to 65504) and from the edge values in EXTREME_F16."""
    qt = QTYPES[name]
    blocks = rng.integers(0, 256, size=(num_blocks, qt.type_size), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        hi = blocks[:, off + 1]
        inf_or_nan = (hi & 0x7C) == 0x7C
        hi[inf_or_nan] &= 0xFB  # drop one exponent bit: finite
        edge = rng.random(num_blocks) < 0.5
        picks = rng.choice(EXTREME_F16, size=int(edge.sum())).view(np.uint8).reshape(-1, 2)
        blocks[edge, off:off + 2] = picks
    return blocks.reshape(-1)


@pytest.mark.parametrize("name", list(QTYPES))
def test_dequantize_matches_gguf_bit_exact(name):
    rng = np.random.default_rng()
    for shape in awkward_shapes(name):
        data = random_qtensor_bytes(name, shape, rng, std=float(rng.uniform(1e-3, 1.0)))
        assert_same_bits(dequantize(name, data, shape), reference(name, data, shape))


@pytest.mark.parametrize("name", list(F16_FIELDS))
def test_dequantize_extreme_scales_bit_exact(name):
    rng = np.random.default_rng()
    shape = (11, 3 * QTYPES[name].block_size)
    data = extreme_blocks(name, 33, rng)
    got = dequantize(name, data, shape)
    assert np.isfinite(got).all()
    assert_same_bits(got, reference(name, data, shape))


@pytest.mark.parametrize("name", ["Q4_K", "F16", "Q8_0"])
def test_dequantize_across_chunks(name, monkeypatch):
    """Tensors bigger than one numpy pass are stitched from passes without gaps or overlap."""
    monkeypatch.setattr(dequant, "_CHUNK_BLOCKS", 3)
    rng = np.random.default_rng()
    shape = (5, 2 * QTYPES[name].block_size)
    data = random_qtensor_bytes(name, shape, rng)
    assert_same_bits(dequantize(name, data, shape), reference(name, data, shape))


@pytest.mark.parametrize("name", list(QTYPES))
def test_dequantize_rows_matches_full(name):
    rng = np.random.default_rng()
    n = 2 * QTYPES[name].block_size
    data = random_qtensor_bytes(name, (17, n), rng)
    full = dequantize(name, data, (17, n))
    for rows in (slice(3, 9), slice(None, None, 5), np.array([16, 0, 4, 4, -1]), np.array([], int)):
        assert_same_bits(dequantize_rows(name, data, n, rows), full[rows])


def test_qtensor_dequantize():
    rng = np.random.default_rng()
    data = random_qtensor_bytes("Q6_K", (3, 256), rng)
    t = QTensor("Q6_K", (3, 256), data)
    assert_same_bits(t.dequantize(), reference("Q6_K", data, (3, 256)))


def test_k4_scales_pack_round_trip():
    rng = np.random.default_rng()
    sc = rng.integers(0, 64, size=(9, 8), dtype=np.uint8)
    m = rng.integers(0, 64, size=(9, 8), dtype=np.uint8)
    sc2, m2 = unpack_k4_scales(pack_k4_scales(sc, m))
    assert np.array_equal(sc, sc2) and np.array_equal(m, m2)


def test_dequantize_wrong_size_names_type_and_sizes():
    data = random_qtensor_bytes("Q4_K", (2, 256), np.random.default_rng())
    with pytest.raises(FormatError, match=r"Q4_K.*288 bytes.*\(3, 256\).*432"):
        dequantize("Q4_K", data, (3, 256))
    with pytest.raises(FormatError, match="Q4_K"):
        dequantize("q4_k", data[:-1], (2, 256))


def test_dequantize_bad_arguments():
    data = random_qtensor_bytes("Q8_0", (2, 64), np.random.default_rng())
    with pytest.raises(UnsupportedError, match="Q7_7"):
        dequantize("Q7_7", data, (2, 64))
    with pytest.raises(UnsupportedError, match="block size"):
        dequantize("Q8_0", data, (4, 34))
    with pytest.raises(InvalidArgument, match="uint8"):
        dequantize("Q8_0", data.view(np.int8), (2, 64))
    with pytest.raises(InvalidArgument, match="shape"):
        dequantize("Q8_0", data, ())


def test_dequantize_rows_bad_arguments():
    data = random_qtensor_bytes("IQ4_XS", (4, 512), np.random.default_rng())
    with pytest.raises(FormatError, match="IQ4_XS"):
        dequantize_rows("IQ4_XS", data, 768, slice(0, 1))
    with pytest.raises(InvalidArgument, match="out of range"):
        dequantize_rows("IQ4_XS", data, 512, np.array([4]))
    with pytest.raises(InvalidArgument, match="integer"):
        dequantize_rows("IQ4_XS", data, 512, np.array([0.5]))
    with pytest.raises(UnsupportedError, match="XQ"):
        dequantize_rows("XQ", data, 512, slice(0, 1))
