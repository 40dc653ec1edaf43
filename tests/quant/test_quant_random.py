"""random_qtensor_bytes: valid bytes of every quant type, finite values near the requested std."""
import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from strata.errors import InvalidArgument, UnsupportedError
from strata.quant import QTYPES, tensor_bytes
from strata.quant.random import random_qtensor_bytes


@pytest.mark.parametrize("name", list(QTYPES))
@pytest.mark.parametrize("std", [0.02, 1.5])
def test_random_bytes_are_valid_with_requested_std(name, std):
    rng = np.random.default_rng()
    shape = (7, 2 * 512)
    data = random_qtensor_bytes(name, shape, rng, std=std)
    assert data.dtype == np.uint8 and data.ndim == 1
    assert data.nbytes == tensor_bytes(name, shape)
    x = gguf_dequantize(data.reshape(shape[0], -1), gguf.GGMLQuantizationType(QTYPES[name].ggml_id))
    assert x.shape == shape
    assert np.isfinite(x).all()
    assert std / 2 < float(x.std()) < std * 2
    assert abs(float(x.mean())) < std / 4


def test_random_bytes_differ_between_calls():
    rng = np.random.default_rng()
    a = random_qtensor_bytes("Q4_K", (2, 256), rng)
    b = random_qtensor_bytes("Q4_K", (2, 256), rng)
    assert not np.array_equal(a, b)


def test_random_bytes_bad_arguments():
    rng = np.random.default_rng()
    with pytest.raises(UnsupportedError, match="Q9_9"):
        random_qtensor_bytes("Q9_9", (1, 32), rng)
    with pytest.raises(UnsupportedError, match="block size"):
        random_qtensor_bytes("Q4_K", (1, 32), rng)
    with pytest.raises(InvalidArgument, match="std"):
        random_qtensor_bytes("Q8_0", (1, 32), rng, std=0.0)
