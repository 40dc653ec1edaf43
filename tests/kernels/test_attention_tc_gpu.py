"""cuda/attention_tc.cu: tensor-core causal prompt attention (and the same on wgmma: cuda/attention_ws.cu at Dh
128, cuda/attention_wg.cu at Dh 64), against
strata.backends.cpu.causal_attention run in float64 on the same f16 K/V.

Tolerance, per (token, head): max|out - ref| <= TOL * max|ref|. Q (scaled by scale * log2 e) and
P are rounded to f16 for the mma: each score moves by ~2^-12 of its |q . k| terms and each weight
by <= 2^-11 relative, which averages out over the cells. An emulation of those roundings in numpy
gives ~7e-4 at unit-variance q and k (TOL 2e-3) and ~3e-3 with 4x sharper scores (TOL_PEAKED 6e-3).
The same tolerances at Dh 256 (the warp-pair kernel): scale = 1 / sqrt(Dh) keeps the scores' spread,
and each score's rounding error grows as sqrt(Dh) terms like it, so the relative errors are those of
Dh 128; the same emulation over 32-cell tiles gives ~6.7e-4 and ~2.3e-3 there (not yet run on the device). Cache cells past the last position hold NaN, so a read past the end fails the test.
"""

import numpy as np
import pytest

from strata.backends.cpu import causal_attention

pytestmark = pytest.mark.gpu

TOL = 2e-3
TOL_PEAKED = 6e-3
F16_NAN = np.uint16(0x7E00).view(np.float16)


@pytest.fixture(scope="module", params=["tc", "wg", "wst"])
def prefill_tc(request):
    """attention_tc.cu's kernels, and the wgmma path's (the same contract: attention_ws.cu at Dh 128,
    attention_wg.cu at Dh 64) where they run; a wg test at Dh 256 skips itself. wst: attention_ws.cu's
    TMA build (Dh 128 and 256), its tensor maps ending at the chunk's last position."""
    from strata.backends.cuda.attention_tc import attention_prefill_tc

    if request.param == "tc":
        return attention_prefill_tc
    import strata.backends.cuda as cuda_backend
    from strata.backends.cuda.kernels import TMA_ATTENTION_CELLS, WG_ATTENTION_HEAD_DIMS, wgmma_unavailable
    rt = cuda_backend._runtime()
    for library in ("attention_wg", "attention_ws"):
        why = wgmma_unavailable(rt.read_manifest(), rt.Device(0).compute_capability, library)
        if why:
            pytest.skip(f"{library}: {why}")

    tma = request.param == "wst"

    def wg(q, *args, **kwargs):
        if q.shape[2] not in (TMA_ATTENTION_CELLS if tma else WG_ATTENTION_HEAD_DIMS):
            pytest.skip(f"the {request.param} path has no Dh {q.shape[2]} kernel")
        return attention_prefill_tc(q, *args, wgmma=True, tma=tma, **kwargs)
    return wg


def reference(q, keys, values, positions):
    f64 = np.float64
    return causal_attention(q.astype(f64), keys.astype(f64), values.astype(f64), positions)


def assert_heads_close(out, ref, H, tol):
    rows, dh = out.shape[0], out.shape[1] // H
    assert np.isfinite(out).all(), "NaN/inf in the output: an unwritten element or a read past the end"
    err = np.abs(out.astype(np.float64) - ref).reshape(rows, H, dh).max(axis=-1)
    scale = np.abs(ref).reshape(rows, H, dh).max(axis=-1)
    worst = float((err / scale).max())
    assert worst <= tol, f"max rel err per head {worst:.3g} > {tol}"


def case(rng, T, p0, H, Hk, dh, sharpness=1.0, positions=None):
    """q, caches with NaN past the last position, positions, and the float64 reference."""
    positions = np.arange(p0, p0 + T) if positions is None else positions
    S = int(positions.max()) + 1 + 9
    q = (rng.standard_normal((T, H, dh)) * sharpness).astype(np.float32)
    k_cache = rng.standard_normal((S, Hk, dh)).astype(np.float16)
    v_cache = rng.standard_normal((S, Hk, dh)).astype(np.float16)
    last = int(positions.max()) + 1
    ref = reference(q, k_cache[:last], v_cache[:last], positions)
    k_cache[last:] = F16_NAN
    v_cache[last:] = F16_NAN
    return q, k_cache, v_cache, positions, ref


# (T, p0, H, Hk, Dh): one token (at 0 and after a cache), T not a multiple of the 64-row block or the
# 64-cell tile, chunks after earlier cells, G = 1, 2, 3, 4, 8, 16, Dh 64 and 128, and Qwen3-30B-A3B
# (32 / 4 heads, Dh 128) at 512 tokens and at 2048 tokens after 2048 cached cells. Dh 256 (the
# warp-pair kernel, 32-cell tiles): the same cases, T * G under one block, offsets off the 32-cell
# tile, and Qwen3-Next-80B (16 / 2 heads, G 8) at 512 tokens and at 700 after 2301 cached cells
PREFILL = [
    (1, 0, 32, 4, 128),
    (1, 777, 32, 4, 128),
    (7, 0, 32, 4, 128),
    (37, 100, 8, 2, 64),
    (100, 0, 32, 4, 128),
    (33, 4000, 32, 4, 128),
    (29, 11, 6, 6, 64),
    (65, 63, 8, 8, 128),
    (13, 50, 12, 4, 128),
    (130, 1, 16, 4, 64),
    (9, 9, 16, 1, 128),
    (200, 300, 16, 1, 64),
    (70, 5, 64, 4, 128),
    (512, 0, 32, 4, 128),
    (2048, 2048, 32, 4, 128),
    (1, 0, 16, 2, 256),
    (1, 777, 16, 2, 256),
    (7, 0, 16, 2, 256),
    (37, 100, 16, 2, 256),
    (100, 0, 32, 4, 256),
    (33, 4000, 16, 2, 256),
    (29, 11, 6, 6, 256),
    (65, 63, 8, 8, 256),
    (13, 50, 12, 4, 256),
    (130, 1, 16, 1, 256),
    (200, 300, 8, 4, 256),
    (70, 5, 64, 4, 256),
    (512, 0, 16, 2, 256),
    (700, 2301, 16, 2, 256),
]


@pytest.mark.parametrize("T,p0,H,Hk,dh", PREFILL)
def test_attention_prefill_tc(prefill_tc, rng, T, p0, H, Hk, dh):
    q, k_cache, v_cache, positions, ref = case(rng, T, p0, H, Hk, dh)
    assert_heads_close(prefill_tc(q, k_cache, v_cache, positions), ref, H, TOL)


@pytest.mark.parametrize("dh", [64, 128, 256])
def test_attention_prefill_tc_peaked_scores(prefill_tc, rng, dh):
    q, k_cache, v_cache, positions, ref = case(rng, 256, 200, 32, 4, dh, sharpness=4.0)
    assert_heads_close(prefill_tc(q, k_cache, v_cache, positions), ref, 32, TOL_PEAKED)


@pytest.mark.parametrize("H,Hk,dh", [(32, 4, 128), (16, 2, 256)])
def test_attention_prefill_tc_positions_with_gaps(prefill_tc, rng, H, Hk, dh):
    # the contract is per-query positions, not a contiguous range: gaps, repeats and unsorted order
    positions = rng.integers(0, 3000, 150)
    positions[:5] = 0
    q, k_cache, v_cache, positions, ref = case(rng, 150, 0, H, Hk, dh, positions=positions)
    assert_heads_close(prefill_tc(q, k_cache, v_cache, positions), ref, H, TOL)


@pytest.mark.parametrize("dh,scale", [(64, 0.3), (256, 0.15)])     # scores 2.4x as spread as at 1/sqrt(dh)
def test_attention_prefill_tc_scale_argument(prefill_tc, rng, dh, scale):
    q, k_cache, v_cache, positions, _ = case(rng, 50, 20, 8, 2, dh)
    ref = reference(q * np.float32(scale * np.sqrt(dh)), k_cache[:70], v_cache[:70], positions)  # cpu scales by 1/sqrt(dh)
    assert_heads_close(prefill_tc(q, k_cache, v_cache, positions, scale=scale), ref, 8, TOL)


@pytest.mark.parametrize("H,Hk,dh", [(32, 4, 128), (16, 2, 256)])
def test_attention_prefill_tc_is_deterministic(prefill_tc, rng, H, Hk, dh):
    q, k_cache, v_cache, positions, _ = case(rng, 300, 1000, H, Hk, dh)
    first = prefill_tc(q, k_cache, v_cache, positions)
    np.testing.assert_array_equal(prefill_tc(q, k_cache, v_cache, positions).view(np.uint32), first.view(np.uint32))


@pytest.mark.parametrize("H,Hk,dh", [(32, 4, 128), (16, 2, 256)])
def test_attention_prefill_tc_matches_ffma_kernel(prefill_tc, rng, H, Hk, dh):
    # the kernel it replaces, at the production shapes (Qwen3-30B-A3B, Qwen3-Next-80B): same
    # contract, so the same answer to ~TOL
    from strata.backends.cuda.testing import CudaOps

    q, k_cache, v_cache, positions, ref = case(rng, 256, 1500, H, Hk, dh)
    ffma = CudaOps().attention_prefill(q, k_cache, v_cache, positions)
    assert_heads_close(prefill_tc(q, k_cache, v_cache, positions), ffma.astype(np.float64), H, TOL)


def test_prefill_tc_launch_shape():
    from strata.backends.cuda.attention_tc import prefill_tc_launch_shape

    assert prefill_tc_launch_shape(512, 32, 4, 128) == ((64, 4), 128)
    assert prefill_tc_launch_shape(1, 16, 1, 64) == ((1, 1), 128)
    assert prefill_tc_launch_shape(65, 8, 8, 128) == ((2, 8), 128)
    assert prefill_tc_launch_shape(512, 16, 2, 256) == ((64, 2), 256)     # 8 warps, two per 16 rows
    assert prefill_tc_launch_shape(7, 16, 2, 256) == ((1, 2), 256)
