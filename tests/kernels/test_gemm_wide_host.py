"""The identity cuda/gemm_wide.cuh's STRATA_K4_FMA build rests on (cuda/moe_gemm_ws.cu's Q4_K / Q5_K
decoders): for every scale a K-quant sub-block can have, dl = f32(f16 d * 6-bit sc), and every quant q
of 0..31, one fma of dl, the biased byte 2^23 + q and -(dl * 2^23) rounds to the float32 product dl * q
exactly as decode8's multiply does, but for the sign of one zero: a negative scale times quant 0 is
-0 by the multiply and +0 by the fma (x - x is +0). So the build's weights equal decode8's in value
everywhere and in bits wherever they are not a zero of a negative scale (llama.cpp's quantizer writes
d >= 0); a GEMM output can differ from moe_gemm.cu's only in the sign of an exact zero.

The fma is emulated in float64, where it is exact here: dl * (2^23 + q) has at most 48 significant bits,
dl * 2^23 is dl scaled by a power of two, and their difference dl * q (at most 29 bits) is representable,
so rounding it once to float32 is the fma's one rounding."""
import numpy as np

TWO23 = np.float32(2.0**23)


def k4_scales() -> np.ndarray:
    """Every finite f16 d times every 6-bit scale, rounded to float32 as the decoders round it."""
    d = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    d = d[np.isfinite(d)].astype(np.float32)
    dl = (d[:, None] * np.arange(64, dtype=np.float32)[None, :]).reshape(-1)
    return np.unique(dl)


def test_one_fma_rounds_the_product_as_the_multiply_does():
    dl = k4_scales()
    assert dl.size > 500_000 and np.isfinite(dl).all()
    c = (-(dl * TWO23)).astype(np.float64)                  # exact in float32: a power-of-two scaling
    assert np.array_equal(c, -(dl.astype(np.float64) * 2.0**23))
    for q in range(32):                                     # Q5_K's quants reach 31, Q4_K's 15
        biased = np.float64(TWO23 + np.float32(q))          # the byte_perm's float: exact
        fma = (dl.astype(np.float64) * biased + c).astype(np.float32)
        mul = dl * np.float32(q)
        assert np.array_equal(fma, mul), f"q {q}: values"
        differ = fma.view(np.uint32) != mul.view(np.uint32)
        assert not (differ & ~((q == 0) & np.signbit(dl))).any(), f"q {q}: bits beyond the zeros of negative scales"
        assert differ.any() == (q == 0)


def test_the_identity_needs_the_power_of_two_bias():
    """With the bias of Q4_0 (2^23 + 8) folded the same way, the bits differ: the fma form is only the
    K-quants' (kSub, bias 2^23), which is why the header keeps the other types' subtraction."""
    dl = k4_scales()[::7]
    bias = np.float32(2.0**23 + 8)
    c = (-(dl * bias)).astype(np.float64)                   # rounded: dl * (2^23 + 8) needs more bits
    q = 5
    fma = (dl.astype(np.float64) * np.float64(bias + np.float32(q)) + c).astype(np.float32)
    assert not np.array_equal(fma, dl * np.float32(q))
