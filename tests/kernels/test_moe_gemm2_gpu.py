"""strata_moe_gemm2_<q> (cuda/moe_gemm.cu's v2: cp.async-staged raw blocks, 128 x 256 tiles) against
strata_moe_gemm_<q> (v1) bit for bit, and against float64 within v1's bounds (test_moe_gemm_gpu.check).

v2 promises v1's bits: the same f16(X) and f16(W) operands and each output's k order (16-wide mma
steps, ascending k), so the engine's bit-identity guarantees hold whichever kernel a launch takes.
Cases: N below, at and past the 256-row CTA, K of one block and several (Q6_K and Q8_0 rows then
start at every 2-byte lead inside a 16-byte chunk), m from 1 to 128 rows a tile, several groups in
shuffled order with gaps, rows outside every tile (must stay NaN), empty tiles and null groups.
"""
import numpy as np
import pytest

from strata.backends.cuda.moe_gemm import BM, BN2, STAGED_SHARED_BYTES, launch_for, staged_fits, tiles_for
from strata.backends.cuda.kernels import STAGED_GEMM_QTYPES
from tests.kernels.test_moe_gemm_gpu import PRODUCTION, check, make_case

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops():
    from strata.backends.cuda.testing import CudaOps

    ops = CudaOps()
    if not staged_fits(ops.device.max_shared_per_block_optin):
        pytest.skip(f"{ops.device.name}: {ops.device.max_shared_per_block_optin} bytes of shared memory a block, "
                    f"v2 needs {max(STAGED_SHARED_BYTES.values())}")
    return ops


def same_bits(a, b):
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))


def both(ops, name, weights, ranges, X, **kw):
    from strata.backends.cuda.moe_gemm import moe_gemm

    y1 = moe_gemm(name, weights, ranges, X, ops=ops, kernel="v1", **kw)
    y2 = moe_gemm(name, weights, ranges, X, ops=ops, kernel="v2", **kw)
    return y1, y2


def ks(name):
    return [32, 96, 768] if name == "Q8_0" else [256, 768, 2048]


@gpu
@pytest.mark.parametrize("name", STAGED_GEMM_QTYPES)
def test_v2_bits_equal_v1_awkward_shapes(ops, rng, name):
    for K in ks(name):
        for N, counts in [(1, [1]), (37, [BM - 1, 3, 130]), (BN2, [64, 65, 128]), (BN2 + 72, [1, 70, BM, 2 * BM + 1, 5]),
                          (3 * BN2 + 17, [33, 96, 127])]:
            weights, ranges, X = make_case(rng, name, N, K, counts)
            y1, y2 = both(ops, name, weights, ranges, X)
            assert same_bits(y1, y2), f"{name} N {N} K {K}: v2 differs from v1 in {int((y1 != y2).sum())} outputs"
            check(name, y2, weights, ranges, X, f"v2 N {N} K {K}")


@gpu
@pytest.mark.parametrize("name", STAGED_GEMM_QTYPES)
def test_v2_bits_equal_v1_every_tile_height(ops, rng, name):
    """m = 1 .. 128 rows a tile (every warp row band boundary), one group per height."""
    K = ks(name)[1]
    counts = list(range(1, BM + 1, 9)) + [63, 64, 65, 127, 128]
    weights, ranges, X = make_case(rng, name, BN2 + 40, K, counts)
    y1, y2 = both(ops, name, weights, ranges, X)
    assert same_bits(y1, y2), f"{name}: v2 differs from v1 in {int((y1 != y2).sum())} outputs"
    check(name, y2, weights, ranges, X, "v2 heights")


@gpu
@pytest.mark.parametrize("name,N,K,rows", [p for p in PRODUCTION if p[0] in STAGED_GEMM_QTYPES])
def test_v2_bits_equal_v1_production_shapes(ops, rng, name, N, K, rows):
    counts = rng.integers(32, 320, size=6) if rows == "experts" else rows
    weights, ranges, X = make_case(rng, name, N, K, counts, std=0.02)
    y1, y2 = both(ops, name, weights, ranges, X)
    assert same_bits(y1, y2), f"{name} N {N} K {K}: v2 differs from v1 in {int((y1 != y2).sum())} outputs"
    check(name, y2, weights, ranges, X, f"v2 N {N} K {K}")


@gpu
@pytest.mark.parametrize("name", STAGED_GEMM_QTYPES)
def test_v2_moved_weights_part_offset_and_null_groups(ops, rng, name):
    """Other addresses and a part offset (other 16-byte leads of nothing: offsets are multiples of 16),
    empty tiles and groups at address 0 in a worst-case grid: the same bits as v1's plain launch."""
    from strata.backends.cuda.moe_gemm import moe_gemm

    K = ks(name)[1]
    weights, ranges, X = make_case(rng, name, BN2 + 40, K, [150, 7, 64, 90])
    base = moe_gemm(name, weights, ranges, X, ops=ops, kernel="v1")
    moved = moe_gemm(name, weights, ranges, X, ops=ops, kernel="v2",
                     offsets=[16 * int(o) for o in rng.integers(1, 64, 4)], part_offset=4096 + 16 * int(rng.integers(0, 8)))
    assert same_bits(base, moved)
    null = int(rng.integers(0, 4))
    tiles = tiles_for(ranges)
    empty = np.zeros((5, 4), np.int32)
    empty[:, 0] = rng.integers(0, 4, 5)
    tiles = np.concatenate([tiles, empty])[rng.permutation(len(tiles) + 5)]
    skipped = [None if g == null else w for g, w in enumerate(weights)]
    Y = moe_gemm(name, skipped, ranges, X, ops=ops, tiles=tiles, kernel="v2")
    for g, s0, rows in ranges:
        got, want = Y[s0:s0 + rows], base[s0:s0 + rows]
        if g == null:
            assert np.isnan(got).all(), "a null group's rows were written"
        else:
            assert same_bits(got, want)


def test_launch_for_picks_v2_where_it_exists_and_fills_the_gpu():
    # Qwen3-30B-A3B experts over a 4096-token chunk's worst-case grid: v2
    assert launch_for("Q4_K", 1536, 128 + 256, True, 132) == ("moe_gemm2", (6, 384), STAGED_SHARED_BYTES["Q4_K"])
    assert launch_for("Q6_K", 2048, 384, True, 132)[0] == "moe_gemm2"
    assert launch_for("Q8_0", 4096, 32, True, 132)[0] == "moe_gemm2"      # dense q projection, 4096 rows
    assert launch_for("Q8_0", 512, 32, True, 132) == ("moe_gemm", (4, 32), 0)   # k/v: 64 CTAs of v2 < 132 SMs
    assert launch_for("Q4_K", 1536, 384, False, 132) == ("moe_gemm", (12, 384), 0)   # path off or no room
    assert launch_for("Q5_K", 1536, 384, True, 132)[0] == "moe_gemm"      # no v2 for the type
    assert staged_fits(227 << 10) and not staged_fits(163 << 10)
