"""strata_moe_combine_f32 (cuda/moe_combine.cu): residual + weighted sum of the experts' outputs.

Tolerance, f32: |err| <= 1e-6 * (|residual| + sum_a |w_a y_a|) per element, the bound of A + 1
roundings (the FMA chain and the final add) against a float64 reference.
"""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

# (T, A, D): 1, primes, D not a multiple of the 256-thread block, Qwen3-30B-A3B's A 8 / D 2048,
# a 10-expert router, a prompt chunk
SHAPES = [(1, 1, 1), (1, 8, 2048), (3, 1, 257), (7, 8, 2048), (13, 10, 1000), (5, 3, 4093), (512, 8, 2048)]


@pytest.fixture(scope="module")
def ops():
    from strata.backends.cuda.testing import CudaOps

    return CudaOps()


def check(out, x, y_rows, w):
    terms = w[:, :, None].astype(np.float64) * y_rows.astype(np.float64)    # [T, A, D]
    ref = x.astype(np.float64) + terms.sum(axis=1)
    bound = 1e-6 * (np.abs(x) + np.abs(terms).sum(axis=1))
    assert out.dtype == np.float32 and np.isfinite(out).all()
    assert (np.abs(out - ref) <= bound).all(), f"max err {np.abs(out - ref).max():.3g}"


@pytest.mark.parametrize("T,A,D", SHAPES)
def test_moe_combine_decode_layout(ops, rng, T, A, D):
    x = rng.standard_normal((T, D)).astype(np.float32)
    y = rng.standard_normal((T, A, D)).astype(np.float32)
    w = rng.dirichlet(np.ones(A), T).astype(np.float32)
    check(ops.moe_combine(x, y, w), x, y, w)


@pytest.mark.parametrize("T,A,D", [(1, 8, 2048), (13, 10, 1000), (64, 8, 2048)])
def test_moe_combine_rows_grouped_by_expert(ops, rng, T, A, D):
    # the prompt path leaves expert outputs grouped by expert: rows[t, a] says where (t, a) went
    x = rng.standard_normal((T, D)).astype(np.float32)
    rows = rng.permutation(T * A).reshape(T, A).astype(np.int32)
    y = rng.standard_normal((T * A, D)).astype(np.float32)
    w = rng.uniform(-1, 1, (T, A)).astype(np.float32)
    check(ops.moe_combine(x, y, w, rows), x, y[rows], w)
