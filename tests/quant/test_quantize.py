"""quantize: the bytes gguf-py writes, readable by our dequantizer, errors for everything else."""
import gguf
import numpy as np
import pytest
from gguf.quants import quantize as gguf_quantize

from strata.errors import InvalidArgument, UnsupportedError
from strata.quant import QTYPES, tensor_bytes
from strata.quant.dequant import dequantize
from strata.quant.quantize import QUANTIZABLE, quantize

# worst-case |error| relative to the largest |weight|: half a step (a whole step where the format
# clips the largest weight's opposite sign: Q4_0, Q5_0); min-offset steps span up to 2 * amax
REL_TOL = {"F32": 0.0, "F16": 2**-11, "BF16": 2**-8, "Q8_0": 0.5 / 127, "Q4_0": 1 / 8,
           "Q4_1": 1 / 15, "Q5_0": 1 / 16, "Q5_1": 1 / 31}


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_quantize_round_trip(name):
    rng = np.random.default_rng()
    x = (rng.standard_normal((3, 5, 96)) * 0.05).astype(np.float32)
    data = quantize(name, x)
    assert data.dtype == np.uint8 and data.ndim == 1
    assert data.nbytes == tensor_bytes(name, x.shape)
    want = np.ascontiguousarray(gguf_quantize(x, gguf.GGMLQuantizationType(QTYPES[name].ggml_id)))
    assert np.array_equal(data, want.view(np.uint8).reshape(-1))
    y = dequantize(name, data, x.shape)
    amax = float(np.abs(x).max())
    # the extra 1e-3 covers the f16 rounding of block scales
    assert float(np.abs(y - x).max()) <= amax * (REL_TOL[name] + 1e-3) + 1e-7


def test_quantize_refuses_other_types():
    x = np.random.default_rng().standard_normal((2, 256)).astype(np.float32)
    for name in set(QTYPES) - set(QUANTIZABLE):
        with pytest.raises(UnsupportedError, match="Q8_0"):
            quantize(name, x)
    with pytest.raises(UnsupportedError, match="Z9"):
        quantize("Z9", x)


def test_quantize_bad_input():
    rng = np.random.default_rng()
    with pytest.raises(UnsupportedError, match="block size"):
        quantize("Q8_0", rng.standard_normal((2, 48)).astype(np.float32))
    with pytest.raises(InvalidArgument, match="floating"):
        quantize("Q8_0", rng.integers(0, 9, size=(2, 32)))
    x = rng.standard_normal((2, 32)).astype(np.float32)
    x[1, 7] = np.nan
    with pytest.raises(InvalidArgument, match="NaN"):
        quantize("Q4_0", x)
