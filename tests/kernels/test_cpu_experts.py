"""strata._ext.cpu_experts (strata/_ext/cpu_experts.h): expert FFNs on the host's cores from quantized
blobs, with 8-bit activations in blocks of 32.

Bounds:
- matmul against float64 over the dequantized weights (strata.quant.dequant, the reference) and the
  dequantized 8-bit activations (the same quantize()): f32 rounding only, rel err < 1e-5 of max |y|.
- quantize(): q in [-127, 127], scale = amax / 127, |q * scale - x| <= scale / 2 (+ f32 rounding).
- expert_ffn against the numpy CPU backend's float32 FFN (dequantized weights, float x): the 8-bit
  activations' rounding, measured at 0.5-0.8% of max |out|; bound 3%. A wrong layout or type is ~100%.
- The AVX2 path and the plain C++ path agree to f32 rounding; any number of threads gives the same bits.
"""
from __future__ import annotations

import numpy as np
import pytest

from strata.backends.cpu import swiglu
from strata.errors import InvalidArgument, UnsupportedError
from strata.quant.dequant import dequantize
from strata.quant.random import random_qtensor_bytes

ce = pytest.importorskip("strata._ext.cpu_experts", reason="strata._ext.cpu_experts is not built")

KINDS = ["Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"]
PATHS = [True, False] if ce.simd() != "scalar" else [False]


def _weights(qt, rows, n, rng):
    w = random_qtensor_bytes(qt, (rows, n), rng)
    return w, dequantize(qt, w, (rows, n)).astype(np.float64)


def _dequant_act(x):
    q, s, _ = ce.quantize(x)
    T, n = q.shape
    return (q.reshape(T, -1, 32).astype(np.float64) * s[:, :, None]).reshape(T, n)


@pytest.mark.parametrize("simd", PATHS, ids=lambda s: "simd" if s else "scalar")
@pytest.mark.parametrize("qt", KINDS)
@pytest.mark.parametrize("T", [1, 3, 9])
def test_matmul_equals_float64_of_the_quantized_operands(qt, T, simd):
    rng = np.random.default_rng(hash((qt, T)) % 2**32)
    R, n = 48, 768
    w, W = _weights(qt, R, n, rng)
    x = rng.standard_normal((T, n)).astype(np.float32) * rng.uniform(0.1, 10, (T, 1)).astype(np.float32)
    ref = _dequant_act(x) @ W.T
    y = ce.matmul(qt, w, R, n, x, simd)
    assert y.shape == (T, R) and y.dtype == np.float32
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("qt", KINDS)
def test_simd_and_scalar_paths_agree(qt):
    if ce.simd() == "scalar":
        pytest.skip("this CPU has no AVX2")
    rng = np.random.default_rng(7)
    w, _ = _weights(qt, 32, 512, rng)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    a, b = ce.matmul(qt, w, 32, 512, x, True), ce.matmul(qt, w, 32, 512, x, False)
    assert np.abs(a - b).max() <= 1e-6 * np.abs(b).max()


def test_quantize_rounds_each_block_of_32():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 256)).astype(np.float32) * 5
    x[1, :32] = 0                                          # a zero block: scale 0, every q 0
    q, s, c = ce.quantize(x)
    blocks = x.reshape(3, -1, 32)
    np.testing.assert_allclose(s, np.abs(blocks).max(axis=2) / 127, rtol=1e-6)
    assert q.min() >= -127 and q.max() <= 127
    err = np.abs(q.reshape(3, -1, 32) * s[:, :, None] - blocks)
    assert (err <= s[:, :, None] * 0.5 * (1 + 1e-5) + 1e-7).all()
    assert (c == q.reshape(3, -1, 32).astype(np.int32).sum(axis=2)).all()
    assert s[1, 0] == 0 and not q[1, :32].any()


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q8_0"), ("Q5_K", "Q4_K", "Q4_0")])
@pytest.mark.parametrize("T", [1, 5])
def test_expert_ffn_against_the_cpu_backend(types, T):
    rng = np.random.default_rng(3)
    D, I = 512, 256
    (g, G), (u, U), (d, Dn) = _weights(types[0], I, D, rng), _weights(types[1], I, D, rng), _weights(types[2], D, I, rng)
    x = rng.standard_normal((T, D)).astype(np.float32)
    out = ce.expert_ffn(types[0], g, types[1], u, types[2], d, D, I, x)
    G, U, Dn = G.astype(np.float32), U.astype(np.float32), Dn.astype(np.float32)
    ref = swiglu(x @ G.T, x @ U.T) @ Dn.T
    assert out.shape == (T, D)
    assert np.abs(out - ref).max() <= 0.03 * np.abs(ref).max()


def test_threads_do_not_change_the_bits():
    rng = np.random.default_rng(5)
    D, I = 512, 256
    g, u, d = (random_qtensor_bytes("Q4_K", s, rng) for s in ((I, D), (I, D), (D, I)))
    x = rng.standard_normal((3, D)).astype(np.float32)
    before = ce.threads()
    try:
        ce.set_threads(1)
        one = ce.expert_ffn("Q4_K", g, "Q4_K", u, "Q4_K", d, D, I, x)
        ce.set_threads(3)
        assert ce.threads() == 3
        three = ce.expert_ffn("Q4_K", g, "Q4_K", u, "Q4_K", d, D, I, x)
    finally:
        ce.set_threads(before)
    assert np.array_equal(one, three)


def test_bad_input_is_refused_with_the_reason():
    rng = np.random.default_rng(0)
    w = random_qtensor_bytes("Q4_K", (8, 256), rng)
    x = np.zeros((1, 256), np.float32)
    with pytest.raises(UnsupportedError, match="IQ4_XS"):
        ce.matmul("IQ4_XS", w, 8, 256, x)
    with pytest.raises(InvalidArgument, match="bytes for 9 rows"):
        ce.matmul("Q4_K", w, 9, 256, x)
    with pytest.raises(InvalidArgument, match="multiple of Q4_K's block of 256"):
        ce.matmul("Q4_K", w, 8, 128, x[:, :128])
    with pytest.raises(InvalidArgument, match="columns"):
        ce.matmul("Q4_K", w, 8, 256, np.zeros((1, 64), np.float32))
    with pytest.raises(InvalidArgument):
        ce.set_threads(0)
    assert ce.matmul("Q4_K", w, 8, 256, np.zeros((0, 256), np.float32)).shape == (0, 8)
