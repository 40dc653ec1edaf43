"""strata_moe_gemm_<q> (cuda/moe_gemm.cu), and strata_moe_gemm_ws_<q> (cuda/moe_gemm_ws.cu, wgmma: the
same contract, on sm_90 GPUs whose build has it), through strata.backends.cuda.moe_gemm against float64.

Reference: each group's weight dequantized by strata.quant (bit-exact with the kernel's decoders),
W and X rounded to f16 as the kernel rounds them, the product in float64. Then only the kernel's
f32 accumulation differs: elementwise |Y - ref| <= K * 2^-22 * (|x16| @ |w16|^T) (a worst case),
and over a case's outputs (64 or more) ||Y - ref|| / ||ref|| < 1e-5 (measured far lower). The header's bound against
the unrounded product, (2^-10 + K * 2^-22) P + 2^-25 (sum |x| + sum |w|), is checked too. Rows
outside every tile must stay NaN (the wrapper poisons Y). Determinism: the same data at other
addresses, behind a part offset, cut into other tiles or among more rows gives identical bits.
"""

import numpy as np
import pytest

from strata.backends.cuda.moe_gemm import BM, BN, QTYPE_NAMES, tiles_for
from strata.quant import QTYPES
from strata.quant.dequant import dequantize
from strata.quant.random import random_qtensor_bytes

gpu = pytest.mark.gpu
RTOL = 1e-5
MIN_OUTPUTS = 64


@pytest.fixture(scope="module")
def ops():
    from strata.backends.cuda.testing import CudaOps

    return CudaOps()


def skip_without_wgmma(ops, what: str) -> None:
    """Skip where cuda/moe_gemm_ws.cu's library cannot run (not sm_90, or a build without it)."""
    import strata.backends.cuda as cuda_backend
    from strata.backends.cuda.kernels import wgmma_unavailable
    why = wgmma_unavailable(cuda_backend._runtime().read_manifest(), ops.device.compute_capability)
    if why:
        pytest.skip(f"{what}: {why}")


@pytest.fixture(params=["moe_gemm", "moe_gemm_ws", "moe_gemm_ws16"])
def op(request):
    """Each build of the contract: cuda/moe_gemm.cu, and cuda/moe_gemm_ws.cu (wgmma; ws16: X given as
    f16) where it runs."""
    if request.param != "moe_gemm":
        skip_without_wgmma(request.getfixturevalue("ops"), request.param)
    return request.param


def random_ranges(rng, row_counts, gap=True):
    """(group, s0, rows) for each count, groups in shuffled order, a row of gap between some."""
    ranges, s = [], 0
    for g in rng.permutation(len(row_counts)):
        s += int(gap and rng.random() < 0.5)
        ranges.append((int(g), s, int(row_counts[g])))
        s += int(row_counts[g])
    return ranges, s + 1


def make_case(rng, name, N, K, row_counts, std=None):
    weights = [random_qtensor_bytes(name, (N, K), rng, std=std or float(rng.uniform(1e-3, 0.5)))
               for _ in row_counts]
    ranges, S = random_ranges(rng, row_counts)
    X = rng.standard_normal((S, K)).astype(np.float32) * np.float32(rng.uniform(0.1, 4.0))
    return weights, ranges, X


def reference(name, weights, ranges, X):
    """(f16-rounded float64 product, unrounded float64 product, worst-case accumulation bound,
    bound against the unrounded product); rows outside every range NaN."""
    S, K = X.shape
    N = weights[0].size // QTYPES[name].row_bytes(K)
    out = [np.full((S, N), np.nan) for _ in range(4)]
    x64 = X.astype(np.float64)
    x16 = X.astype(np.float16).astype(np.float64)
    for g, s0, rows in ranges:
        w32 = dequantize(name, weights[g], (N, K))
        w64, w16 = w32.astype(np.float64), w32.astype(np.float16).astype(np.float64)
        sl = slice(s0, s0 + rows)
        P = np.abs(x64[sl]) @ np.abs(w64).T
        out[0][sl] = x16[sl] @ w16.T
        out[1][sl] = x64[sl] @ w64.T
        out[2][sl] = K * 2.0**-22 * (np.abs(x16[sl]) @ np.abs(w16).T) + 1e-30
        out[3][sl] = ((2.0**-10 + K * 2.0**-22) * P + 2.0**-25 * (np.abs(x64[sl]).sum(1)[:, None] +
                                                                   np.abs(w64).sum(1)[None, :]) + 1e-30)
    return out


def check(name, Y, weights, ranges, X, what=""):
    ref16, ref, acc_bound, bound = reference(name, weights, ranges, X)
    assert Y.shape == ref.shape
    untouched = np.isnan(ref16)
    assert np.isnan(Y[untouched]).all(), f"{name} {what}: wrote rows outside the tiles"
    y, r16 = Y[~untouched].astype(np.float64), ref16[~untouched]
    assert np.isfinite(y).all(), f"{name} {what}: non-finite outputs"
    assert (np.abs(y - r16) <= acc_bound[~untouched]).all(), f"{name} {what}: accumulation bound exceeded"
    assert (np.abs(y - ref[~untouched]) <= bound[~untouched]).all(), f"{name} {what}: stated bound exceeded"
    if y.size >= MIN_OUTPUTS:   # one dot product of random data can be near zero: no relative error
        err = float(np.linalg.norm(y - r16) / np.linalg.norm(r16))
        assert err < RTOL, f"{name} {what}: rel err {err:.2e}"


def awkward_k(name):
    bs = QTYPES[name].block_size
    return [8, 40] if bs == 1 else [bs, 3 * bs] if bs == 32 else [bs, 2 * bs]


@gpu
@pytest.mark.parametrize("name", QTYPE_NAMES)
def test_moe_gemm_awkward_sizes(ops, op, rng, name):
    """K of one block and a few, N below / not a multiple of BN, m = 1, rows around BM, gaps."""
    from strata.backends.cuda.moe_gemm import moe_gemm

    for K in awkward_k(name):
        for N, counts in [(1, [1]), (BN + 72, [1, 70, BM, 2 * BM + 1, 5]), (37, [BM - 1, 3, 130])]:
            weights, ranges, X = make_case(rng, name, N, K, counts)
            check(name, moe_gemm(name, weights, ranges, X, ops=ops, op=op), weights, ranges, X, f"N {N} K {K}")


# (name, N, K, rows per group): Qwen3-30B-A3B experts (gate|up fused, down), dense projections
# (one group tiled), a head-like slice with few rows; and the experts as f16 rows (tma-gemm's
# operands: moe_gemm_ws16 copies both by cp.async)
PRODUCTION = [("Q4_K", 1536, 2048, "experts"), ("Q4_K", 2048, 768, "experts"), ("Q6_K", 2048, 768, "experts"),
              ("Q8_0", 512, 4096, [1000]), ("Q8_0", 4096, 2048, [300]), ("Q8_0", 20000 + 37, 2048, [3]),
              ("F16", 1536, 2048, "experts"), ("F16", 2048, 768, "experts")]


@gpu
@pytest.mark.parametrize("name,N,K,rows", PRODUCTION)
def test_moe_gemm_production_shapes(ops, op, rng, name, N, K, rows):
    from strata.backends.cuda.moe_gemm import moe_gemm

    counts = rng.integers(32, 320, size=6) if rows == "experts" else rows
    weights, ranges, X = make_case(rng, name, N, K, counts, std=0.02)
    check(name, moe_gemm(name, weights, ranges, X, ops=ops, op=op), weights, ranges, X, f"N {N} K {K}")


@gpu
@pytest.mark.parametrize("N,K,counts", [(1536, 2048, "experts"), (2048, 768, "experts"), (4096, 2048, [300]),
                                        (BN + 72, 40, [1, 70, BM, 2 * BM + 1, 5]), (37, 8, [BM - 1, 3, 130]),
                                        (512, 4096, [1000]), (20000 + 37, 2048, [3])])
def test_moe_gemm_wst_is_ws16_bit_for_bit(ops, rng, N, K, counts):
    """strata_moe_gemm_wst_f16 (the TMA build, tma-gemm's GEMM): within the bounds against float64, and
    strata_moe_gemm_ws16_f16's outputs bit for bit (the same MMAs in the same k order; only how the
    operands reach shared memory differs), a null group skipped, behind a part offset."""
    from strata.backends.cuda.moe_gemm import moe_gemm
    skip_without_wgmma(ops, "moe_gemm_wst")
    counts = rng.integers(32, 320, size=6) if counts == "experts" else counts
    weights, ranges, X = make_case(rng, "F16", N, K, counts, std=0.02)
    if len(weights) > 2:
        weights[1] = None
        ranges = [r for r in ranges if r[0] != 1]
    got = moe_gemm("F16", weights, ranges, X, ops=ops, op="moe_gemm_wst", part_offset=32)
    check("F16", got, weights, ranges, X, f"wst N {N} K {K}")
    want = moe_gemm("F16", weights, ranges, X, ops=ops, op="moe_gemm_ws16")
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), \
        f"N {N} K {K}: {np.count_nonzero(got.view(np.uint32) != want.view(np.uint32))} outputs differ from ws16"


@gpu
@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "Q6_K", "BF16"])
def test_moe_gemm_deterministic(ops, op, rng, name):
    """Identical bits when the weights move (other offsets, a part offset), when tiles are cut at
    other rows, and when the same rows sit among more rows (other S, other tile count)."""
    from strata.backends.cuda.moe_gemm import moe_gemm

    K = 512
    weights, ranges, X = make_case(rng, name, BN + 40, K, [150, 7, 64, 90])
    base = moe_gemm(name, weights, ranges, X, ops=ops, op=op)
    moved = moe_gemm(name, weights, ranges, X, ops=ops, op=op, offsets=[16 * int(o) for o in rng.integers(1, 64, 4)],
                     part_offset=4096 + 16 * int(rng.integers(0, 8)))
    assert np.array_equal(base.view(np.uint32), moved.view(np.uint32))
    tiles = []
    for g, s0, rows in ranges:      # random tile lengths: rows land at other positions in a tile
        s = s0
        while s < s0 + rows:
            m = min(int(rng.integers(1, BM + 1)), s0 + rows - s)
            tiles.append((g, s, m, 0))
            s += m
    recut = moe_gemm(name, weights, ranges, X, ops=ops, op=op,
                     tiles=np.array(tiles, np.int32)[rng.permutation(len(tiles))])
    assert np.array_equal(base.view(np.uint32), recut.view(np.uint32))
    pad = 11
    X2 = np.concatenate([rng.standard_normal((pad, K)).astype(np.float32), X])
    more = [(g, s0 + pad, rows) for g, s0, rows in ranges] + [(0, 0, pad)]
    shifted = moe_gemm(name, weights, more, X2, ops=ops, op=op)
    assert np.array_equal(base.view(np.uint32), shifted[pad:].view(np.uint32))


def test_tiles_for_cuts_ranges_into_bm_rows():
    tiles = tiles_for([(2, 0, 2 * BM + 3), (0, 500, 1), (1, 9, 0)])
    assert tiles.dtype == np.int32 and tiles.shape == (4, 4)
    assert tiles.tolist() == [[2, 0, BM, 0], [2, BM, BM, 0], [2, 2 * BM, 3, 0], [0, 500, 1, 0]]
    assert tiles_for([]).shape == (0, 4)


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "F16"])
def test_fake_emulation_matches_reference(rng, name):
    """tests/engine/fake_moe_gemm.py on fake_cuda memory, within the same bounds as the kernel."""
    from tests.engine import fake_cuda
    from tests.engine.fake_moe_gemm import emulate_moe_gemm

    K = awkward_k(name)[-1]
    weights, ranges, X = make_case(rng, name, BN + 9, K, [3, 70, 1])
    dev = fake_cuda.Device()
    bufs = [fake_cuda.DeviceBuffer(dev, w.size + 32) for w in weights]
    for b, w in zip(bufs, weights):
        b.copy_from_host(w, offset=32)
    tiles = tiles_for(ranges)
    args = [np.array([b.ptr for b in bufs], np.uint64), tiles, X]
    ptrs, tiles_dev, x_dev = (fake_cuda.DeviceBuffer(dev, a.nbytes) for a in args)
    for buf, a in zip((ptrs, tiles_dev, x_dev), args):
        buf.copy_from_host(a)
    N = BN + 9
    y_dev = fake_cuda.DeviceBuffer(dev, X.shape[0] * N * 4)
    emulate_moe_gemm(name, (2, len(tiles), 1), ptrs.ptr, 32, tiles_dev.ptr, x_dev.ptr, K, y_dev.ptr, N, N, K)
    Y = np.empty((X.shape[0], N), np.float32)
    y_dev.copy_to_host(Y)
    check(name, Y, weights, ranges, X, "fake")


@gpu
@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
def test_moe_gemm_skips_empty_tiles_and_null_groups(ops, op, rng, name):
    """A worst-case grid as device-side grouping launches it: tiles with m = 0 and groups at address 0
    (experts another batch computes) do nothing; the rest is bit for bit the plain launch."""
    from strata.backends.cuda.moe_gemm import moe_gemm, tiles_for

    K = 512
    weights, ranges, X = make_case(rng, name, BN + 40, K, [150, 7, 64, 90])
    base = moe_gemm(name, weights, ranges, X, ops=ops, op=op)
    null = int(rng.integers(0, 4))
    tiles = tiles_for(ranges)
    empty = np.zeros((5, 4), np.int32)
    empty[:, 0] = rng.integers(0, 4, 5)         # m = 0 whatever the group
    tiles = np.concatenate([tiles, empty])[rng.permutation(len(tiles) + 5)]
    skipped = [None if g == null else w for g, w in enumerate(weights)]
    Y = moe_gemm(name, skipped, ranges, X, ops=ops, op=op, tiles=tiles)
    for g, s0, rows in ranges:
        got, want = Y[s0:s0 + rows], base[s0:s0 + rows]
        if g == null:
            assert np.isnan(got).all(), "a null group's rows were written"
        else:
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
