"""cuda/kv_quant.cu against strata.quant.kv (the numpy reference the CPU backend uses).

- Appends and the rotation: bit for bit (the kernels follow the reference's butterfly order, division
  and rounding; see the .cu header).
- The dequantize to f16 (the prompt path's scratch): the reference's decoded cells rounded to f16,
  bit for bit.
- Decode attention over int8, q4_0 and k8v4 planes: against causal attention in float64 on the
  planes' dequantized cells (exact in f32), the query rotated and the output un-rotated as the
  format says. Tolerance as attention.cu's f16 decode: per (sequence, head) max|out - ref| <= 1e-5 *
  max|ref| (f32 scores and sums only). Scales of cells past each sequence's length are NaN, so a read
  past the end fails.

The check_* functions also run on the emulated runtime (tests/engine/test_kv_quant_host.py).
"""
import numpy as np
import pytest

from strata.backends.cpu import causal_attention
from strata.quant import kv as kvq

pytestmark = pytest.mark.gpu

TOL = 1e-5
F16_NAN = np.uint16(0x7E00).view(np.float16)


@pytest.fixture(scope="module")
def kvops():
    from strata.backends.cuda.testing import CudaOps
    from strata.backends.cuda.kv import KVQuantOps
    return KVQuantOps(CudaOps())


def heads(rng, shape):
    """K/V-like rows: normal, one outlier channel, a zero head and a tie of magnitudes."""
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., 5] *= 30.0
    x.reshape(-1, shape[-1])[0] = 0.0
    x.reshape(-1, shape[-1])[-1, :2] = (2.0, -2.0)
    return x


def check_append(kvops, rng, codec_name: str, T: int, Hk: int, dh: int) -> None:
    codec = kvq.CODECS[codec_name]
    rows = T + 3
    x = heads(rng, (T, Hk, dh))
    cells = rng.permutation(rows)[:T].astype(np.int32)
    values, scales = codec.empty((rows, Hk), dh)
    values[:] = rng.integers(0, 100, values.shape).astype(values.dtype)     # rows not written stay as they were
    scales[:] = 7.0
    got_v, got_s = kvops.append(codec_name, x, cells, values, scales)
    want_v, want_s = values.copy(), scales.copy()
    want_v[cells], want_s[cells] = codec.encode(x)
    assert np.array_equal(got_s.view(np.uint16), want_s.view(np.uint16))
    assert np.array_equal(got_v, want_v)


def check_hadamard(kvops, rng, rows: int, dh: int) -> None:
    x = heads(rng, (rows, dh))
    assert np.array_equal(kvops.hadamard(x).view(np.uint32), kvq.rotate(x).view(np.uint32))


def check_dequant(kvops, rng, codec_name: str, rows: int, Hk: int, dh: int) -> None:
    codec = kvq.CODECS[codec_name]
    values, scales = codec.encode(heads(rng, (rows, Hk, dh)))
    want = codec.decode(values, scales).astype(np.float16)
    assert np.array_equal(kvops.dequant_f16(codec_name, values, scales).view(np.uint16), want.view(np.uint16))


def check_decode(kvops, rng, fmt: str, B: int, H: int, Hk: int, dh: int, S: int, splits=None) -> None:
    kc, vc = kvq.codecs(fmt)
    lengths = rng.integers(1, S + 1, B).astype(np.int32)
    lengths[0] = S
    k, v = heads(rng, (B, S, Hk, dh)), rng.standard_normal((B, S, Hk, dh)).astype(np.float32)
    kp, vp = kc.encode(k), vc.encode(v)
    for _, scales in (kp, vp):
        for b, n in enumerate(lengths):
            scales[b, n:] = F16_NAN
    q = rng.standard_normal((B, H, dh)).astype(np.float32)
    got = kvops.attention_decode(fmt, q, kp, vp, lengths, num_splits=splits)
    G = H // Hk
    for b, n in enumerate(lengths):
        keys = kc.decode(kp[0][b, :n], kp[1][b, :n]).astype(np.float64)
        vals = vc.decode(vp[0][b, :n], vp[1][b, :n]).astype(np.float64)
        qb = kvq.rotate(q[b]) if kc.rotated else q[b]
        ref = causal_attention(qb[None].astype(np.float64), keys, vals, np.array([n - 1]))[0].reshape(H, dh)
        if vc.rotated:
            ref = kvq.rotate(ref.astype(np.float32)).astype(np.float64)    # H is its own inverse
        out = got[b].reshape(H, dh)
        err = np.abs(out - ref).max(axis=-1)
        assert np.all(err <= TOL * np.abs(ref).max(axis=-1) + 1e-6), (fmt, b, n, G, err.max())


@pytest.mark.parametrize("codec", ["int8", "q4r"])
@pytest.mark.parametrize("T, Hk, dh", [(1, 1, 64), (7, 4, 128), (13, 2, 256), (64, 8, 128)])
def test_append(kvops, rng, codec, T, Hk, dh):
    check_append(kvops, rng, codec, T, Hk, dh)


@pytest.mark.parametrize("codec", ["int8", "q4r"])
@pytest.mark.parametrize("rows, Hk, dh", [(1, 1, 64), (37, 4, 128), (5, 2, 256)])
def test_dequant(kvops, rng, codec, rows, Hk, dh):
    check_dequant(kvops, rng, codec, rows, Hk, dh)


@pytest.mark.parametrize("rows, dh", [(1, 64), (37, 128), (5, 256)])
def test_hadamard(kvops, rng, rows, dh):
    check_hadamard(kvops, rng, rows, dh)


@pytest.mark.parametrize("fmt", ["int8", "q4_0", "k8v4"])
@pytest.mark.parametrize("B, H, Hk, dh, S, splits", [
    (1, 4, 4, 64, 1, None), (2, 32, 4, 128, 331, None), (1, 16, 2, 256, 97, 7), (3, 6, 2, 128, 4099, None),
    (1, 16, 1, 64, 17, 3), (1, 32, 4, 128, 32768, None)])
def test_decode(kvops, rng, fmt, B, H, Hk, dh, S, splits):
    check_decode(kvops, rng, fmt, B, H, Hk, dh, S, splits)
