"""strata_moe_route_f32 (cuda/moe_route.cu) against strata.backends.cpu.moe_route.

Ids: exact equality (order included). Weights, f32: rel 1e-6; expf is within 2 ulp of numpy's exp
and the sums round differently, a few ulp (~3e-7) in all.
"""

import numpy as np
import pytest

from strata.backends.cpu import moe_route

pytestmark = pytest.mark.gpu

# (T, E, A): one expert, primes, Qwen3-30B-A3B (128 experts, top 8), Qwen3-Next class (512, top 10),
# E not a multiple of the warp, a prompt chunk
CASES = [(1, 1, 1), (1, 128, 8), (3, 7, 3), (7, 128, 8), (13, 60, 4), (5, 257, 10), (33, 512, 10),
         (2, 32, 32), (512, 128, 8)]


@pytest.fixture(scope="module")
def ops():
    from strata.backends.cuda.testing import CudaOps

    return CudaOps()


def check(ops, logits, top_k, norm):
    ids, weights = ops.moe_route(logits, top_k, norm)
    ref_ids, ref_weights = moe_route(logits, top_k, norm)
    assert ids.dtype == np.int32 and weights.dtype == np.float32
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_weights, rtol=1e-6, atol=0)


@pytest.mark.parametrize("T,E,A", CASES)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "raw"])
def test_moe_route_random_logits(ops, rng, T, E, A, norm):
    check(ops, (rng.standard_normal((T, E)) * 2).astype(np.float32), A, norm)


@pytest.mark.parametrize("T,E,A", [(9, 128, 8), (4, 512, 10), (3, 33, 5)])
def test_moe_route_ties_go_to_the_lower_id(ops, rng, T, E, A):
    # few distinct logits: equal logits give bit-equal probabilities on both sides
    check(ops, rng.integers(-2, 3, (T, E)).astype(np.float32), A, True)


@pytest.mark.parametrize("where", ["one", "all", "inf"])
def test_moe_route_nan_and_inf_logits_pick_as_the_reference(ops, rng, where):
    # a NaN logit makes every probability NaN on both sides: the picks are the first A ids in order (a
    # stable argsort of -p), each of them a valid expert; an -inf logit is a zero probability
    logits = rng.standard_normal((3, 128)).astype(np.float32)
    if where == "one":
        logits[1, 17] = np.nan
    elif where == "all":
        logits[:] = np.nan
    else:
        logits[:, ::3] = -np.inf
    check(ops, logits, 8, True)
    check(ops, logits, 8, False)


# (T, E, A, n): one row and a verify window of the 30B's router, rows shorter than a unit of 8 (n % 8
# != 0), the Qwen3-Next class, one expert, E past a warp's multiple
ROUTER_CASES = [(1, 128, 8, 2048), (4, 128, 8, 2048), (8, 128, 8, 2048), (3, 60, 4, 100), (1, 512, 10, 64),
                (5, 1, 1, 8), (2, 257, 10, 13)]


@pytest.mark.parametrize("T,E,A,n", ROUTER_CASES)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "raw"])
def test_router_routes_in_its_last_block(ops, rng, T, E, A, n, norm):
    """strata_router_split_f32 / strata_router_rows_split_f32 (cuda/gemv.cu): the logits of
    strata_gemv_split_f32 / strata_gemv_rows_split_f32 (one row a lane against two: the same sums) and
    the picks of strata_moe_route_f32 on them, bit for bit, on any grid; launched again and again on one
    counter (its last block resets it)."""
    from strata.backends.cuda.memory import gemv_grid, router_grid

    W = rng.standard_normal((E, n)).astype(np.float32)
    x = (rng.standard_normal((T, n)) * 0.5).astype(np.float32)
    w_dev, x_dev = ops._upload(W), ops._upload(x)
    grid = 4 * gemv_grid("F32", E, n)
    ref = ops._output(T * E * 4)
    if T == 1:
        ops._launch("gemv_split", grid, (w_dev, x_dev, ref, E, n), qtype="F32")
    else:
        ops._launch("gemv_rows_split", grid, (w_dev, x_dev, ref, E, n, T), qtype="F32")
    ref_logits = ops._download(ref, (T, E), np.float32)
    ref_ids, ref_weights = ops.moe_route(ref_logits, A, norm)
    counter = ops._upload(np.zeros(64, np.int32))
    for g in (router_grid(E, n), 1, 3, grid + 5, router_grid(E, n)):
        y, ids, weights = ops._output(T * E * 4), ops._output(T * A * 4), ops._output(T * A * 4)
        tail = (ids, weights, counter, A, int(norm))
        if T == 1:
            ops._launch("router_split", g, (w_dev, x_dev, y, E, n, *tail))
        else:
            ops._launch("router_rows_split", g, (w_dev, x_dev, y, E, n, T, *tail))
        logits = ops._download(y, (T, E), np.float32)
        np.testing.assert_array_equal(logits.view(np.uint32), ref_logits.view(np.uint32), err_msg=f"grid {g}")
        np.testing.assert_array_equal(ops._download(ids, (T, A), np.int32), ref_ids, err_msg=f"grid {g}")
        got_w = ops._download(weights, (T, A), np.float32)
        np.testing.assert_array_equal(got_w.view(np.uint32), ref_weights.view(np.uint32), err_msg=f"grid {g}")
        assert ops._download(counter, (64,), np.int32)[0] == 0, f"grid {g}: the counter was not reset"
