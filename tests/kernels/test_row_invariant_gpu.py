"""Row invariance, the property speculative verify windows and parallel slots rest on: row b of a batched
launch is bit for bit the one-token launch on row b alone, for every batch size 1..8.

- strata_gemv_rows_<q> against strata_gemv_<q>, strata_gemv_rows_split_<q> against strata_gemv_split_<q>
  (cuda/gemv.cu, gemv_rows.cuh's multi bodies), every quant type the decode GEMV reads;
- strata_gemv3_rows_<q> against strata_gemv3_<q> with batch 1 (cuda/decode_fused.cu);
- strata_gemv_one_<q> and strata_gemv3_one_<q> (one row a warp) against the same one-token launches;
- split-K decode attention over one sequence's cache for T query rows (max_cells 0: every row reads
  the same cells; lengths = positions + 1; the one-row split count) against T one-row launches, each
  row through attention.cu's kernel, attention_dec_tc.cu's, or the one its length names.

Outputs are poisoned with NaN first, so a skipped element fails; equality is of the float bits.
"""

import numpy as np
import pytest

from strata.backends.cuda.kernels import ONE_ROW_QTYPES
from strata.quant import QTYPES
from strata.quant.random import random_qtensor_bytes
from tests.kernels.test_row_kernels_gpu import Dev

pytestmark = pytest.mark.gpu

GEMV_TYPES = [q for q in QTYPES]          # every type strata_gemv_* reads


@pytest.fixture(scope="module")
def dev():
    return Dev()


def _bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("qt", GEMV_TYPES)
@pytest.mark.parametrize("rows,n,split", [(300, 512, False), (6, 2048, True), (37, 256, False), (40, 4096, False),
                                          (24, 8192, False)])
def test_gemv_rows_equal_one_token_launches(dev, qt, rows, n, split):
    # (40, 4096): rows longer than one tile of x a batch of several tokens stages in shared memory;
    # (24, 8192): longer than one token's tile too
    if qt in ("F32", "F16", "BF16") and rows == 37:
        n = 100                                            # the float types' n % 8 != 0 units
    rng = np.random.default_rng(abs(hash((qt, rows, n))) % 2**32)
    W = dev.put(random_qtensor_bytes(qt, (rows, n), rng))
    X = rng.standard_normal((8, n)).astype(np.float32)
    xp = dev.put(X)
    suffix = "split_" if split else ""
    one = dev.kernel("gemv", f"strata_gemv_{suffix}{qt.lower()}", "PPPii")
    multi = dev.kernel("gemv", f"strata_gemv_rows_{suffix}{qt.lower()}", "PPPiii")
    grid = max(1, -(-rows // 16))
    ref = np.empty((8, rows), np.float32)
    for b in range(8):
        buf, host = dev.out((rows,))
        one.launch(grid, 128, (W, xp + 4 * n * b, buf.ptr, rows, n), stream=dev.stream)
        ref[b] = dev.get(buf, host)
        if b < 2 and not split:     # a capped grid (a block's rounds over a tile of x staged once): the same bits
            for g in (1, 3):
                buf, host = dev.out((rows,))
                one.launch(g, 128, (W, xp + 4 * n * b, buf.ptr, rows, n), stream=dev.stream)
                assert np.array_equal(_bits(dev.get(buf, host)), _bits(ref[b])), (qt, b, g)
    assert np.isfinite(ref).all()
    if qt in ONE_ROW_QTYPES and not split:      # one row a warp: the same bits, any grid
        one_row = dev.kernel("gemv", f"strata_gemv_one_{qt.lower()}", "PPPii")
        for b in range(3):
            for g in (-(-rows // 4), 1, 5):
                buf, host = dev.out((rows,))
                one_row.launch(g, 128, (W, xp + 4 * n * b, buf.ptr, rows, n), stream=dev.stream)
                assert np.array_equal(_bits(dev.get(buf, host)), _bits(ref[b])), ("one", qt, b, g)
    for batch in range(1, 9):
        for g in (grid, 1, 3):                             # any grid is complete, and the bits hold
            buf, host = dev.out((batch, rows))
            multi.launch(g, 128, (W, xp, buf.ptr, rows, n, batch), stream=dev.stream)
            got = dev.get(buf, host)
            assert np.array_equal(_bits(got), _bits(ref[:batch])), (qt, batch, g)


@pytest.mark.parametrize("qt", ["Q4_K", "Q8_0", "Q6_K", "IQ4_XS", "F16", "BF16", "Q4_0", "IQ4_NL"])
@pytest.mark.parametrize("n,rows", [(512, (256, 64, 64)), (4096, (64, 16, 16))])
def test_gemv3_rows_equal_batch_one(dev, qt, n, rows):
    rng = np.random.default_rng(11)
    Ws = [dev.put(random_qtensor_bytes(qt, (r, n), rng)) for r in rows]
    X = rng.standard_normal((8, n)).astype(np.float32)
    xp = dev.put(X)
    one = dev.kernel("decode_fused", f"strata_gemv3_{qt.lower()}", "PPPPPPPiiiii")
    multi = dev.kernel("decode_fused", f"strata_gemv3_rows_{qt.lower()}", "PPPPPPPiiiii")
    grid = 24
    ref = [np.empty((8, r), np.float32) for r in rows]
    for b in range(8):
        outs = [dev.out((r,)) for r in rows]
        one.launch(grid, 128, (*Ws, xp + 4 * n * b, *(o[0].ptr for o in outs), *rows, n, 1), stream=dev.stream)
        for i, (buf, host) in enumerate(outs):
            ref[i][b] = dev.get(buf, host)
    if qt in ONE_ROW_QTYPES:     # one row a warp, x staged once a block for its rounds: batch 1's bits
        one_row = dev.kernel("decode_fused", f"strata_gemv3_one_{qt.lower()}", "PPPPPPPiiiii")
        for b in range(3):
            for g in (-(-sum(rows) // 4), 1, 7):
                outs = [dev.out((r,)) for r in rows]
                one_row.launch(g, 128, (*Ws, xp + 4 * n * b, *(o[0].ptr for o in outs), *rows, n, 1), stream=dev.stream)
                for i, (buf, host) in enumerate(outs):
                    assert np.array_equal(_bits(dev.get(buf, host)), _bits(ref[i][b])), ("one", qt, b, g, i)
    for batch in (2, 5, 8):
        outs = [dev.out((batch, r)) for r in rows]
        multi.launch(grid, 128, (*Ws, xp, *(o[0].ptr for o in outs), *rows, n, batch), stream=dev.stream)
        for i, (buf, host) in enumerate(outs):
            assert np.array_equal(_bits(dev.get(buf, host)), _bits(ref[i][:batch])), (qt, batch, i)


@pytest.mark.parametrize("cut", ["cuda-cores", "tensor-cores", "by-length"])
@pytest.mark.parametrize("dh,H,Hk", [(128, 32, 4), (64, 16, 16), (128, 8, 1)])
def test_decode_attention_rows_equal_one_row_launches(dev, dh, H, Hk, cut):
    """cut: which f16 kernel takes each row (tc_from): attention.cu's every row, attention_dec_tc.cu's
    every row, or each row's by its length (rows of p0 + 4 cells and more on the tensor cores): the
    batched rows then take both launches, each kernel skipping the other's rows, and each row equals
    its one-row launch through the kernel its length names."""
    from strata.backends.cuda.kernels import INT32_MAX, KERNELS, decode_splits
    rng = np.random.default_rng(dh + H)
    G = H // Hk
    gp = next(g for g in (1, 2, 4, 8, 16) if g >= G)
    cells, T, p0 = 3000, 6, 2500                          # window rows at positions p0 .. p0 + T - 1
    tc_from = {"cuda-cores": INT32_MAX, "tensor-cores": 0, "by-length": p0 + 4}[cut]
    K = (rng.standard_normal((cells, Hk, dh)) * 0.5).astype(np.float16)
    V = rng.standard_normal((cells, Hk, dh)).astype(np.float16)
    Q = rng.standard_normal((T, H, dh)).astype(np.float32)
    kp, vp, qp = dev.put(K), dev.put(V), dev.put(Q)
    splits = decode_splits(1, Hk, cells, dh, dev.dev.multiprocessor_count)
    cc = dev.kernel("attention", f"strata_attention_decode_f16_d{dh}_g{gp}", KERNELS["attention_decode"].signature)
    tc = dev.kernel("attention_dec_tc", f"strata_attention_decode_tc_f16_d{dh}_g{gp}",
                    KERNELS["attention_decode_tc"].signature)
    combine = dev.kernel("attention", "strata_attention_decode_combine_f32", "PPPiii")
    scale = 1 / np.sqrt(dh)
    lengths = np.arange(p0 + 1, p0 + T + 1, dtype=np.int32)
    lp = dev.put(lengths)
    part_acc = dev.rt.DeviceBuffer(dev.dev, T * H * splits * dh * 4)
    part_ml = dev.rt.DeviceBuffer(dev.dev, T * H * splits * 2 * 4)

    def decode(grid, args, rows_lengths):
        """The launches the engine makes for rows of these lengths (ops_attention._attention_decode)."""
        if min(rows_lengths) < tc_from:
            cc.launch(grid, 128, (*args, tc_from), stream=dev.stream)
        if max(rows_lengths) >= tc_from:
            tc.launch(grid, 128, (*args, tc_from), stream=dev.stream)

    ref = np.empty((T, H * dh), np.float32)
    for t in range(T):
        buf, host = dev.out((H * dh,))
        decode((splits, Hk, 1), (qp + 4 * H * dh * t, kp, vp, lp + 4 * t, 0, part_acc.ptr, part_ml.ptr, H, Hk, cells,
                                 splits, scale, 0, 0, 0, 0, 0), lengths[t:t + 1])
        combine.launch((H, 1), 128, (part_acc.ptr, part_ml.ptr, buf.ptr, H, dh, splits), stream=dev.stream)
        ref[t] = dev.get(buf, host)
    assert np.isfinite(ref).all()
    buf, host = dev.out((T, H * dh))
    decode((splits, Hk, T), (qp, kp, vp, lp, 0, part_acc.ptr, part_ml.ptr, H, Hk, 0, splits, scale, 0, 0, 0, 0, 0),
           lengths)
    combine.launch((H, T), 128, (part_acc.ptr, part_ml.ptr, buf.ptr, H, dh, splits), stream=dev.stream)
    assert np.array_equal(_bits(dev.get(buf, host)), _bits(ref))
