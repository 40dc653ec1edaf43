"""strata_embed_<type> (cuda/embed.cu): rows of a token-embedding table, dequantized straight from its
block bytes, bit-identical to strata.quant.dequant.dequantize_rows, for every type strata.quant reads."""
import re
from pathlib import Path

import numpy as np
import pytest

from strata.backends.cuda.kernels import EMBED_QTYPES
from strata.quant import QTYPES, tensor_bytes
from strata.quant.dequant import dequantize_rows
from strata.quant.random import random_qtensor_bytes

ROOT = Path(__file__).resolve().parents[2]
# (rows, n, T): one row; rows of an awkward count and ids with repeats (Q3_K's 110-byte rows at n 256
# start only 2-byte aligned, Q5_0's 22-byte blocks likewise); Qwen3-30B-A3B's D 2048; a prompt chunk
# of 512 over 4096 rows at n 768 (3 K-quant blocks a row)
CASES = [(1, 256, 1), (37, 256, 5), (1000, 2048, 7), (301, 768, 64), (4096, 768, 512)]
FLOAT_CASES = [(3, 1, 2), (17, 97, 5), (300, 8, 9)]     # float types take any n


@pytest.fixture(scope="module")
def ops():
    from strata.backends.cuda.testing import CudaOps

    return CudaOps()


def test_every_type_has_an_embed_kernel():
    """The one list of the kernel's types is the entry points cuda/embed.cu defines, and covers QTYPES."""
    src = (ROOT / "cuda" / "embed.cu").read_text()
    defined = {m.upper() for m in re.findall(r"^STRATA_EMBED\((\w+),", src, re.M)}
    assert defined == set(EMBED_QTYPES) == set(QTYPES)


def _check(ops, rng, qtype, rows, n, T):
    table = random_qtensor_bytes(qtype, (rows, n), rng, std=0.5)
    ids = rng.integers(0, rows, T).astype(np.int32)
    ids[-1] = rows - 1  # the last row too
    out = ops.embed(qtype, table, n, ids)
    assert out.shape == (T, n) and out.dtype == np.float32
    np.testing.assert_array_equal(out, dequantize_rows(qtype, table, n, ids))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,n,T", CASES)
@pytest.mark.parametrize("qtype", EMBED_QTYPES)
def test_embed_matches_dequantize_rows(ops, rng, qtype, rows, n, T):
    _check(ops, rng, qtype, rows, n, T)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,n,T", FLOAT_CASES)
@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16"])
def test_embed_float_rows_of_any_length(ops, rng, qtype, rows, n, T):
    _check(ops, rng, qtype, rows, n, T)


@pytest.mark.gpu
def test_embed_full_qwen3_vocabulary(ops, rng):
    # Qwen3's 151936 x 2048 token embedding in Q8_0 (330 MB): the first, the last and random rows
    qtype, rows, n = "Q8_0", 151936, 2048
    table = random_qtensor_bytes(qtype, (rows, n), rng)
    assert table.size == tensor_bytes(qtype, (rows, n))
    ids = np.concatenate([[0, rows - 1], rng.integers(0, rows, 14)]).astype(np.int32)
    np.testing.assert_array_equal(ops.embed(qtype, table, n, ids), dequantize_rows(qtype, table, n, ids))
