"""strata_embed_<type> (cuda/embed.cu): rows of a token-embedding table, dequantized straight from its
block bytes, bit-identical to strata.quant.dequant.dequantize_rows."""

import numpy as np
import pytest

from strata.quant import tensor_bytes
from strata.quant.dequant import dequantize_rows
from strata.quant.random import random_qtensor_bytes

pytestmark = pytest.mark.gpu

QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q6_K"]
# (rows, n, T): one row, a few ids with repeats, Qwen3-30B-A3B's D 2048, a prompt chunk
CASES = [(1, 256, 1), (37, 256, 5), (1000, 2048, 7), (300, 768, 64), (4096, 2048, 512)]


@pytest.fixture(scope="module")
def ops():
    from strata.backends.cuda import CudaOps

    return CudaOps()


@pytest.mark.parametrize("rows,n,T", CASES)
@pytest.mark.parametrize("qtype", QTYPES)
def test_embed_matches_dequantize_rows(ops, rng, qtype, rows, n, T):
    table = random_qtensor_bytes(qtype, (rows, n), rng, std=0.5)
    ids = rng.integers(0, rows, T).astype(np.int32)
    ids[-1] = rows - 1  # the last row too
    out = ops.embed(qtype, table, n, ids)
    assert out.shape == (T, n) and out.dtype == np.float32
    np.testing.assert_array_equal(out, dequantize_rows(qtype, table, n, ids))


def test_embed_full_qwen3_vocabulary(ops, rng):
    # Qwen3's 151936 x 2048 token embedding in Q8_0 (330 MB): the first, the last and random rows
    qtype, rows, n = "Q8_0", 151936, 2048
    table = random_qtensor_bytes(qtype, (rows, n), rng)
    assert table.size == tensor_bytes(qtype, (rows, n))
    ids = np.concatenate([[0, rows - 1], rng.integers(0, rows, 14)]).astype(np.int32)
    np.testing.assert_array_equal(ops.embed(qtype, table, n, ids), dequantize_rows(qtype, table, n, ids))
