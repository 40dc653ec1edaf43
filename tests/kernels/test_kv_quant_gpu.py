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


def check_decode(kvops, rng, fmt: str, B: int, H: int, Hk: int, dh: int, S: int, splits=None, lengths=None) -> None:
    kc, vc = kvq.codecs(fmt)
    if lengths is None:
        lengths = rng.integers(1, S + 1, B).astype(np.int32)
        lengths[0] = S
    lengths = np.asarray(lengths, np.int32)
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


# The decode kernels run both products on the tensor cores over tiles of 16 cells (32 a warp step at
# Dh <= 128), a lane holding 4 cells' scores: lengths around and between the tiles, every group size
# (hi and lo halves stacked in one MMA at G <= 8, two MMAs at 16), every head dim.
@pytest.mark.parametrize("fmt", ["int8", "q4_0", "k8v4"])
@pytest.mark.parametrize("dh, G", [(dh, G) for dh in (64, 128, 256) for G in (1, 2, 3, 4, 6, 8, 16)
                                   if G <= (8 if dh == 256 else 16)])
def test_decode_groups(kvops, rng, fmt, dh, G):
    Hk = 2
    check_decode(kvops, rng, fmt, 4, G * Hk, Hk, dh, 300, lengths=[300, 1, 47, 129])


@pytest.mark.parametrize("fmt", ["int8", "q4_0", "k8v4"])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_decode_short_lengths(kvops, rng, fmt, splits):
    lengths = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 100, 127, 128, 129, 191, 255, 256, 300]
    check_decode(kvops, rng, fmt, len(lengths), 32, 4, 128, 300, splits, lengths=lengths)


@pytest.mark.parametrize("fmt", ["int8", "q4_0"])
def test_decode_32k_fresh(kvops, fmt):
    rng = np.random.default_rng()        # fresh inputs each run; the seed is in the failure
    seed = int(rng.integers(1 << 31))
    check_decode(kvops, np.random.default_rng(seed), fmt, 2, 32, 4, 128, 32768, lengths=[32768, 32767])


@pytest.mark.parametrize("fmt", ["int8", "q4_0", "k8v4"])
@pytest.mark.parametrize("dh, H, Hk", [(128, 32, 4), (64, 32, 2), (256, 16, 2)])
def test_decode_rows_with_bases_equal_one_row_launches(kvops, rng, fmt, dh, H, Hk):
    """Rows of several sequences in one cache (bases per row, lengths per row): each row of one launch
    equals, bit for bit, its own one-row launch, and the reference within TOL."""
    ops, (kc, vc) = kvops.ops, kvq.codecs(fmt)
    cells = 1200
    bases = np.array([0, 700, 300, 0, 1000, 17], np.int32)
    lengths = np.array([500, 333, 1, 699, 200, 16], np.int32)
    T = len(bases)
    k, v = heads(rng, (cells, Hk, dh)), rng.standard_normal((cells, Hk, dh)).astype(np.float32)
    kp, vp = kc.encode(k), vc.encode(v)
    q = rng.standard_normal((T, H, dh)).astype(np.float32)
    qk = kvq.rotate(q) if kc.rotated else q
    splits = ops.decode_splits(1, Hk, cells, dh)
    planes = [ops._upload(np.ascontiguousarray(a)) for a in (*kp, *vp)]
    q_dev, len_dev, base_dev = ops._upload(qk), ops._upload(lengths), ops._upload(bases)
    gp = 1 << (H // Hk - 1).bit_length()
    scale = float(1 / np.sqrt(dh))

    def run(rows, q_ptr, len_ptr, base_ptr):
        part_acc, part_ml = ops._output(rows * H * splits * dh * 4), ops._output(rows * H * splits * 2 * 4)
        out = ops._output(rows * H * dh * 4)
        ops._launch("attention_decode_quant", (splits, Hk, rows),
                    (q_ptr, *(p.ptr for p in planes), len_ptr, base_ptr, part_acc.ptr, part_ml.ptr, H, Hk, 0,
                     splits, scale), fmt=fmt, dh=dh, g=gp)
        ops._launch("attention_combine", (H, rows), (part_acc.ptr, part_ml.ptr, out.ptr, H, dh, splits))
        return ops._download(out, (rows, H * dh), np.float32)

    got = run(T, q_dev.ptr, len_dev.ptr, base_dev.ptr)
    for t in range(T):
        one = run(1, q_dev.ptr + 4 * t * H * dh, len_dev.ptr + 4 * t, base_dev.ptr + 4 * t)
        assert np.array_equal(one[0].view(np.uint32), got[t].view(np.uint32)), (fmt, t)
        n, b0 = lengths[t], bases[t]
        keys = kc.decode(kp[0][b0:b0 + n], kp[1][b0:b0 + n]).astype(np.float64)
        vals = vc.decode(vp[0][b0:b0 + n], vp[1][b0:b0 + n]).astype(np.float64)
        ref = causal_attention(qk[t][None].astype(np.float64), keys, vals, np.array([n - 1]))[0].reshape(H, dh)
        err = np.abs(got[t].reshape(H, dh) - ref).max(axis=-1)
        assert np.all(err <= TOL * np.abs(ref).max(axis=-1) + 1e-6), (fmt, t, err.max())
