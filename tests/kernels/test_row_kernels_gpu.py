"""The kernels no engine test pack reaches, launched directly through the runtime against numpy:
strata_gather_rows_f32 (cuda/gather_rows.cu), strata_gemm_f32_nt (cuda/gemm_f32.cu),
strata_attention_rows_f16 (cuda/attention_rows.cu) and strata_moe_gemv_<qtype> (cuda/moe_gemv.cu).

Each output is poisoned with NaN before the launch, so an element a kernel skips fails.
Tolerances:
- gather_rows: a copy, bit for bit.
- gemm_f32: f32 FMAs over K, |err| <= 4 K 2^-24 sum_k |a_k b_k| per element against float64.
- attention_rows: f16 K/V exact in f32, f32 softmax with expf: rel err (norm over all outputs) < 1e-5.
- moe_gemv: W dequantized by strata.quant.dequant, rel err < 1e-5 against float64 (gemv.cu's bound, the
  same row body).
"""

import numpy as np
import pytest

from strata.quant import QTYPES, qtype
from strata.quant.dequant import dequantize
from strata.quant.random import random_qtensor_bytes

pytestmark = pytest.mark.gpu


class Dev:
    """One device, one stream, buffers from numpy arrays; every launch checked by synchronizing."""

    def __init__(self):
        from strata._ext import runtime as rt
        self.rt, self.dev = rt, rt.Device(0)
        self.stream = rt.Stream(self.dev)
        self.keep = []

    def kernel(self, lib: str, name: str, sig: str):
        return self.rt.load_library(lib).kernel(self.dev, name, sig)

    def put(self, arr: np.ndarray) -> int:
        arr = np.ascontiguousarray(arr)
        buf = self.rt.DeviceBuffer(self.dev, max(arr.nbytes, 16))
        buf.copy_from_host(arr)
        self.keep.append(buf)
        return buf.ptr

    def out(self, shape, dtype=np.float32):
        poison = np.full(shape, np.nan, dtype=dtype)
        buf = self.rt.DeviceBuffer(self.dev, max(poison.nbytes, 16))
        buf.copy_from_host(poison)
        self.keep.append(buf)
        return buf, poison

    def get(self, buf, like: np.ndarray) -> np.ndarray:
        self.stream.synchronize()
        buf.copy_to_host(like)
        return like


@pytest.fixture(scope="module")
def dev():
    return Dev()


@pytest.mark.parametrize("R,n,src_ld,dst_ld,gather", [
    (1, 1, 1, 1, False), (1, 4096, 4096, 4096, False), (7, 257, 260, 300, True), (13, 96, 96, 96, True),
    (300, 33, 40, 33, True), (70000, 4, 4, 8, True)])
def test_gather_rows_copies_bit_for_bit(dev, rng, R, n, src_ld, dst_ld, gather):
    src_rows = R + 5
    src = rng.standard_normal((src_rows, src_ld)).astype(np.float32)
    rows = rng.integers(0, src_rows, R).astype(np.int32) if gather else None
    k = dev.kernel("gather_rows", "strata_gather_rows_f32", "PPPiqqq")
    buf, host = dev.out((R, dst_ld))
    grid = (max(1, min(64, -(-n // 256))), min(R, 65535))
    k.launch(grid, 256, (dev.put(src), dev.put(rows) if gather else 0, buf.ptr, R, n, src_ld, dst_ld), stream=dev.stream)
    got = dev.get(buf, host)
    ref = src[rows if gather else np.arange(R), :n]
    assert np.array_equal(got[:, :n], ref)
    assert np.isnan(got[:, n:]).all()           # columns past n untouched


@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (1, 768, 2048), (3, 65, 17), (64, 64, 16), (97, 130, 257),
                                   (512, 2048, 768)])
def test_gemm_f32_nt_matches_float64(dev, rng, M, N, K):
    lda, ldb, ldc = K + 3, K, N + 1
    a = rng.standard_normal((M, lda)).astype(np.float32)
    b = rng.standard_normal((N, ldb)).astype(np.float32)
    k = dev.kernel("gemm_f32", "strata_gemm_f32_nt", "PPPiiiqqq")
    buf, host = dev.out((M, ldc))
    k.launch((-(-N // 64), -(-M // 64)), 256, (dev.put(a), dev.put(b), buf.ptr, M, N, K, lda, ldb, ldc),
             stream=dev.stream)
    got = dev.get(buf, host)
    a64, b64 = a[:, :K].astype(np.float64), b[:, :K].astype(np.float64)
    ref = a64 @ b64.T
    bound = 4 * K * 2.0 ** -24 * (np.abs(a64) @ np.abs(b64).T)
    assert np.isfinite(got[:, :N]).all()
    assert (np.abs(got[:, :N] - ref) <= bound).all(), f"max err {np.abs(got[:, :N] - ref).max():.3g}"
    assert np.isnan(got[:, N:]).all()


def attention_ref(q, kc, vc, positions, scale):
    T, H, Dh = q.shape
    G = H // kc.shape[1]
    out = np.zeros((T, H, Dh))
    for t in range(T):
        last = positions[t]
        for h in range(H):
            kk = kc[: last + 1, h // G].astype(np.float64)
            s = scale * (kk @ q[t, h].astype(np.float64))
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ vc[: last + 1, h // G].astype(np.float64)
    return out.reshape(T, H * Dh)


@pytest.mark.parametrize("T,H,Hk,Dh,S", [(1, 1, 1, 1, 1), (1, 4, 2, 96, 50), (5, 24, 1, 80, 37), (3, 8, 8, 256, 300),
                                         (7, 32, 2, 48, 1025)])
def test_attention_rows_matches_float64(dev, rng, T, H, Hk, Dh, S):
    q = rng.standard_normal((T, H, Dh)).astype(np.float32)
    kc = rng.standard_normal((S, Hk, Dh)).astype(np.float16)
    vc = rng.standard_normal((S, Hk, Dh)).astype(np.float16)
    positions = np.sort(rng.integers(0, S, T)).astype(np.int32)
    positions[-1] = S - 1
    scale = float(Dh ** -0.5)
    k = dev.kernel("attention_rows", "strata_attention_rows_f16", "PPPPPiiiif")
    buf, host = dev.out((T, H * Dh))
    k.launch((H, T), 128, (dev.put(q), dev.put(kc), dev.put(vc), dev.put(positions), buf.ptr, T, H, Hk, Dh, scale),
             stream=dev.stream)
    got = dev.get(buf, host)
    ref = attention_ref(q, kc, vc, positions, scale)
    assert np.isfinite(got).all()
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 1e-5, f"rel err {err:.2e}"


@pytest.mark.parametrize("name", list(QTYPES))
@pytest.mark.parametrize("T,A,E,rows,nblocks,gate_up", [(1, 1, 1, 1, 1, True), (1, 8, 16, 96, 3, True),
                                                        (3, 10, 12, 33, 2, False), (2, 5, 7, 256, 1, True)])
def test_moe_gemv_matches_float64(dev, rng, name, T, A, E, rows, nblocks, gate_up):
    """Gate/up layout (x_div = A: slot s reads token s // A's row) and down layout (x_div = 1), each
    expert's matrix at a part offset inside its own blob, ids drawn with repeats."""
    from strata.backends.cuda.memory import gemv_grid
    q = qtype(name)
    n = nblocks * (q.block_size if q.block_size > 1 else 24)     # float types: units of 8 weights
    mat_bytes = q.row_bytes(n) * rows
    offset = 16 * int(rng.integers(0, 4))                  # the part's place in the blob (16-byte aligned)
    blob_bytes = -(-(offset + mat_bytes) // 16) * 16
    mats = [random_qtensor_bytes(name, (rows, n), rng, 0.5) for _ in range(E)]
    blobs = np.zeros((E, blob_bytes), dtype=np.uint8)
    for e, m in enumerate(mats):
        blobs[e, offset: offset + mat_bytes] = m
    base = dev.put(blobs)
    ptrs = np.array([base + e * blob_bytes for e in range(E)], dtype=np.uint64)
    slots = T * A
    ids = rng.integers(0, E, slots).astype(np.int32)
    x_div = A if gate_up else 1
    x = rng.standard_normal((slots // x_div, n)).astype(np.float32)
    k = dev.kernel("moe_gemv", f"strata_moe_gemv_{name.lower()}", "PqPPiPii")
    buf, host = dev.out((slots, rows))
    k.launch((gemv_grid(name, rows, n), slots), 128,
             (dev.put(ptrs), offset, dev.put(ids), dev.put(x), x_div, buf.ptr, rows, n), stream=dev.stream)
    got = dev.get(buf, host)
    ref = np.stack([dequantize(name, mats[ids[s]], (rows, n)).astype(np.float64) @ x[s // x_div].astype(np.float64)
                    for s in range(slots)])
    assert np.isfinite(got).all()
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 1e-5, f"{name}: rel err {err:.2e}"
