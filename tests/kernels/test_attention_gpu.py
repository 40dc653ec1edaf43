"""cuda/attention.cu: KV append, split-K decode + combine, causal prompt attention, against
strata.backends.cpu.causal_attention run in float64 on the f16-rounded K/V. The decode cases also run
cuda/attention_dec_tc.cu's kernel of the same contract (tensor cores, Dh 64 and 128; the tc fixture).

Tolerance, f32 arithmetic over f16 K/V: per (token, head), max|out - ref| <= 1e-5 * max|ref|. Scores
carry ~1e-6 absolute error (f32 dots of Dh terms, q pre-scaled by scale * log2 e), which moves
each probability by ~1e-6 relative; the P V sums round over at most a few hundred cells per split.
Cache cells past each sequence's length hold NaN, so a read past the end fails the test.
"""

import numpy as np
import pytest

from strata.backends.cpu import causal_attention
from strata.config import KV_VRAM_SLACK

pytestmark = pytest.mark.gpu

TOL = 1e-5
F16_NAN = np.uint16(0x7E00).view(np.float16)


@pytest.fixture(scope="module")
def ops():
    from strata.backends.cuda.testing import CudaOps

    return CudaOps()


@pytest.fixture(params=[False, True], ids=["cuda_cores", "tensor_cores"])
def tc(request):
    """Which f16 split-K decode kernel: attention.cu's, or attention_dec_tc.cu's (the engine's for rows of
    TC_DECODE_FROM cells and more)."""
    return request.param


def skip_tc(tc, dh):
    from strata.backends.cuda.kernels import TC_DECODE_HEAD_DIMS
    if tc and dh not in TC_DECODE_HEAD_DIMS:
        pytest.skip(f"attention_dec_tc.cu has no Dh {dh} kernel")


def random_cache(rng, shape):
    return rng.standard_normal(shape).astype(np.float16)


def reference(q, keys, values, positions):
    f64 = np.float64
    return causal_attention(q.astype(f64), keys.astype(f64), values.astype(f64), positions)


def assert_heads_close(out, ref, H):
    rows, dh = out.shape[0], out.shape[1] // H
    err = np.abs(out.astype(np.float64) - ref).reshape(rows, H, dh).max(axis=-1)
    scale = np.abs(ref).reshape(rows, H, dh).max(axis=-1)
    assert np.isfinite(out).all(), "NaN/inf in the output: an unwritten element or a read past the length"
    worst = float((err / scale).max())
    assert worst <= TOL, f"max rel err per head {worst:.3g} > {TOL}"


# ---- KV append -----------------------------------------------------------------------------

@pytest.mark.parametrize("T,Hk,dh,rows", [(1, 4, 128, 16), (7, 4, 128, 4096), (33, 2, 256, 100), (5, 3, 64, 5)])
def test_kv_append_rounds_to_f16_at_the_cells(ops, rng, T, Hk, dh, rows):
    k = (rng.standard_normal((T, Hk, dh)) * 10).astype(np.float32)
    v = (rng.standard_normal((T, Hk, dh)) * 10).astype(np.float32)
    cells = rng.permutation(rows)[:T].astype(np.int32)
    k_cache, v_cache = random_cache(rng, (rows, Hk, dh)), random_cache(rng, (rows, Hk, dh))
    new_k, new_v = ops.kv_append(k, v, cells, k_cache, v_cache)
    want_k, want_v = k_cache.copy(), v_cache.copy()
    want_k[cells], want_v[cells] = k.astype(np.float16), v.astype(np.float16)
    np.testing.assert_array_equal(new_k.view(np.uint16), want_k.view(np.uint16))
    np.testing.assert_array_equal(new_v.view(np.uint16), want_v.view(np.uint16))


# ---- decode --------------------------------------------------------------------------------

# (H, Hk, Dh, lengths, S): Qwen3-30B-A3B (32/4 heads, Dh 128) at 1, 4096 and 16384 cells; G = 1, 2,
# 3 (padded to 4), 16 (Qwen3-235B's 64/4, and 16/1); Dh 64 and 256; batches of mixed lengths
DECODE = [
    (32, 4, 128, [1], 64),
    (32, 4, 128, [4096], 4096),
    (32, 4, 128, [16384], 16384),
    (32, 4, 128, [1, 2, 4095, 300], 4096),
    (8, 8, 64, [1, 37, 1000], 1024),
    (4, 2, 64, [31, 64], 64),
    (12, 4, 128, [513, 77], 600),
    (16, 1, 128, [100, 3001], 3001),
    (64, 4, 128, [777], 1000),
    (16, 2, 256, [2049], 2100),
    (8, 8, 256, [3, 17], 20),
]


def decode_case(rng, H, Hk, dh, lengths, S, sharpness=1.0):
    B = len(lengths)
    q = (rng.standard_normal((B, H, dh)) * sharpness).astype(np.float32)
    k_cache, v_cache = random_cache(rng, (B, S, Hk, dh)), random_cache(rng, (B, S, Hk, dh))
    refs = []
    for b, L in enumerate(lengths):
        refs.append(reference(q[b:b + 1], k_cache[b, :L], v_cache[b, :L], np.array([L - 1])))
        k_cache[b, L:] = F16_NAN
        v_cache[b, L:] = F16_NAN
    return q, k_cache, v_cache, np.array(lengths, np.int32), np.concatenate(refs)


@pytest.mark.parametrize("H,Hk,dh,lengths,S", DECODE)
def test_attention_decode(ops, rng, tc, H, Hk, dh, lengths, S):
    skip_tc(tc, dh)
    q, k_cache, v_cache, lengths, ref = decode_case(rng, H, Hk, dh, lengths, S)
    assert_heads_close(ops.attention_decode(q, k_cache, v_cache, lengths, tc=tc), ref, H)


@pytest.mark.parametrize("H,Hk,dh", [(32, 4, 128), (8, 8, 64), (16, 2, 256)])
def test_attention_decode_rows_of_several_sequences_by_bases(ops, rng, tc, H, Hk, dh):
    # parallel slots' batched step: one cache of N sequences back to back, each row from its
    # sequence's first cell (bases), in any order, two rows of one sequence too; each row's bits
    # equal that row launched alone over its own sequence (what that slot's one-row step computes)
    skip_tc(tc, dh)
    N, S = 3, 700
    _, k_cache, v_cache, _, _ = decode_case(rng, H, Hk, dh, [S] * N, S)
    seqs, lengths = np.array([2, 0, 2, 1]), np.array([700, 1, 333, 64], np.int32)
    q = rng.standard_normal((4, H, dh)).astype(np.float32)
    out = ops.attention_decode(q, k_cache, v_cache, lengths, num_splits=4, bases=seqs * S, tc=tc)
    for b, (seq, L) in enumerate(zip(seqs, lengths)):
        alone = ops.attention_decode(q[b:b + 1], k_cache[seq:seq + 1], v_cache[seq:seq + 1], lengths[b:b + 1],
                                     num_splits=4, tc=tc)
        assert np.array_equal(out[b].view(np.uint32), alone[0].view(np.uint32)), f"row {b}"
        assert_heads_close(out[b:b + 1], reference(q[b:b + 1], k_cache[seq, :L], v_cache[seq, :L],
                                                   np.array([L - 1])), H)


@pytest.mark.parametrize("num_splits", [1, 3, 1024])
@pytest.mark.parametrize("sharpness", [1.0, 6.0])
def test_attention_decode_any_split_count(ops, rng, tc, num_splits, sharpness):
    # one split, an odd count, and far more splits than tiles (most of them empty); peaked softmax
    q, k_cache, v_cache, lengths, ref = decode_case(rng, 32, 4, 128, [1, 1000, 2047], 2048, sharpness)
    assert_heads_close(ops.attention_decode(q, k_cache, v_cache, lengths, num_splits, tc=tc), ref, 32)


@pytest.mark.parametrize("rotated", [False, True])
def test_attention_combine_leaves_empty_splits_out_bit_for_bit(ops, rng, rotated):
    """The combine skips splits that read no cells ((m, l) = (-inf, 0), acc zeros: a cache sized past the row
    leaves most splits so). Against the same partials with each empty split made a used one of weight 0 (m
    so low that its weight underflows to 0, l and acc zeros: the sums the loop then reads are the empty
    ones' terms before the skip), the outputs are the same bits; a split of NaN scores (m -inf, l NaN) is not
    empty: its NaN sum of weights leaves its head zeros (the combine's rule for a sum not above 0)."""
    B, H, dh, used, splits = 2, 8, 128, 24, 100
    place = np.sort(rng.choice(splits, used, replace=False))          # the used splits among 100
    acc = np.zeros((B, H, splits, dh), np.float32)
    ml = np.tile(np.array([-np.inf, 0.0], np.float32), (B, H, splits, 1))
    acc[:, :, place] = rng.standard_normal((B, H, used, dh))
    ml[:, :, place, 0] = rng.uniform(-30, 5, (B, H, used))
    ml[:, :, place, 1] = rng.uniform(0.5, 40, (B, H, used))
    ml[0, 3, place[5]] = (-np.inf, np.nan)                            # NaN scores: kept
    tiny = ml.copy()
    empty = np.isneginf(ml[..., 0]) & (ml[..., 1] == 0)
    tiny[..., 0][empty] = -1e30                                        # weight exp2(-1e30 - M) = 0, read

    def combine(m):
        splits_ = acc.shape[2]
        out = ops._output(B * H * dh * 4)
        args = (ops._upload(acc), ops._upload(m), out, H, dh, splits_)
        if rotated:
            ops._launch("attention_combine_rot", (H, B), (*args, float(np.float32(1 / np.sqrt(dh)))))
        else:
            ops._launch("attention_combine", (H, B), args)
        return ops._download(out, (B, H, dh), np.float32)
    skipped, read = combine(ml), combine(tiny)
    assert np.array_equal(skipped.view(np.uint32), read.view(np.uint32))
    assert (skipped[0, 3] == 0).all() and np.isfinite(skipped).all() and (skipped[0, 2] != 0).any()


def test_kv_append_then_decode(ops, rng):
    # the decode step's order: append this token's K/V at its position, then attend with length pos + 1
    H, Hk, dh, S, pos = 32, 4, 128, 512, 300
    k_cache, v_cache = random_cache(rng, (S, Hk, dh)), random_cache(rng, (S, Hk, dh))
    k = rng.standard_normal((1, Hk, dh)).astype(np.float32)
    v = rng.standard_normal((1, Hk, dh)).astype(np.float32)
    k_cache, v_cache = ops.kv_append(k, v, np.array([pos]), k_cache, v_cache)
    q = rng.standard_normal((1, H, dh)).astype(np.float32)
    out = ops.attention_decode(q, k_cache[None], v_cache[None], np.array([pos + 1]))
    keys = np.concatenate([k_cache[:pos], k.astype(np.float16)])
    values = np.concatenate([v_cache[:pos], v.astype(np.float16)])
    assert_heads_close(out, reference(q, keys, values, np.array([pos])), H)


# ---- prompt --------------------------------------------------------------------------------

# (T, p0, H, Hk, Dh): one token, primes, a chunk after 4000 cached cells, G = 1, 3, 8, 16, Dh 64 /
# 128 / 256, and a 512-token chunk of Qwen3-30B-A3B after 1024 cached cells
PREFILL = [
    (1, 0, 32, 4, 128),
    (7, 0, 32, 4, 128),
    (37, 100, 8, 2, 64),
    (100, 0, 32, 4, 128),
    (33, 4000, 32, 4, 128),
    (5, 3, 16, 2, 256),
    (40, 0, 16, 2, 256),
    (29, 11, 6, 6, 64),
    (13, 50, 12, 4, 128),
    (9, 9, 16, 1, 128),
    (512, 1024, 32, 4, 128),
]


@pytest.mark.parametrize("T,p0,H,Hk,dh", PREFILL)
def test_attention_prefill(ops, rng, T, p0, H, Hk, dh):
    S = p0 + T + 5
    q = rng.standard_normal((T, H, dh)).astype(np.float32)
    k_cache, v_cache = random_cache(rng, (S, Hk, dh)), random_cache(rng, (S, Hk, dh))
    positions = np.arange(p0, p0 + T)
    ref = reference(q, k_cache[:p0 + T], v_cache[:p0 + T], positions)
    k_cache[p0 + T:] = F16_NAN
    v_cache[p0 + T:] = F16_NAN
    assert_heads_close(ops.attention_prefill(q, k_cache, v_cache, positions), ref, H)


def test_attention_prefill_peaked_scores(ops, rng):
    T, p0, H, Hk, dh = 64, 200, 32, 4, 128
    q = (rng.standard_normal((T, H, dh)) * 4).astype(np.float32)
    k_cache, v_cache = random_cache(rng, (p0 + T, Hk, dh)), random_cache(rng, (p0 + T, Hk, dh))
    positions = np.arange(p0, p0 + T)
    out = ops.attention_prefill(q, k_cache, v_cache, positions)
    assert_heads_close(out, reference(q, k_cache, v_cache, positions), H)


def window_ring(cache, length, ring_cells):
    """--kv-resident's VRAM window of one sequence's cache [S, Hk, Dh] after `length` cells: cell c at
    c % ring_cells for the newest ring_cells cells, NaN in slots no cell reached."""
    ring = np.full((ring_cells,) + cache.shape[1:], np.nan, cache.dtype)
    for c in range(max(0, length - ring_cells), length):
        ring[c % ring_cells] = cache[c]
    return ring


@pytest.mark.parametrize("H,Hk,dh", [(32, 4, 128), (8, 8, 64), (16, 2, 256)])
@pytest.mark.parametrize("length,ring_cells,rows", [(5000, 1024, 1), (5000, 333, 1), (700, 2048, 1),
                                                    (1024, 1024, 1), (3001, 100, 6), (40, 64, 8)])
def test_attention_decode_vram_window_bitwise(ops, rng, tc, H, Hk, dh, length, ring_cells, rows):
    # --kv-resident: rows of one sequence (lengths length - rows + 1 .. length) read their newest cells
    # from the ring and the rest from the cache, whose cells in the window are NaN here, so a cell
    # read from the wrong place fails; the bits equal the same launch over the whole cache
    skip_tc(tc, dh)
    S = length + 3
    k_cache, v_cache = random_cache(rng, (1, S, Hk, dh)), random_cache(rng, (1, S, Hk, dh))
    lengths = np.arange(length - rows + 1, length + 1, dtype=np.int32)
    q = rng.standard_normal((rows, H, dh)).astype(np.float32)
    bases = np.zeros(rows, np.int32)
    want = ops.attention_decode(q, k_cache, v_cache, lengths, bases=bases, tc=tc)
    ring = (window_ring(k_cache[0], length, ring_cells), window_ring(v_cache[0], length, ring_cells))
    for r in ring:                  # 8 rejected speculative rows' cells: the slack's slots, never read
        r[np.arange(length, length + 8) % ring_cells] = F16_NAN
    # every row reads these from VRAM (VramWindow: the ring's newest ring_cells - KV_VRAM_SLACK)
    lo = max(0, length + rows - 1 - (ring_cells - KV_VRAM_SLACK))
    k_cache[0, lo:], v_cache[0, lo:] = F16_NAN, F16_NAN
    got = ops.attention_decode(q, k_cache, v_cache, lengths, bases=bases, vram=ring, tc=tc)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# ---- decode of short rows in one cluster launch (cluster-decode) ---------------------------------------

def skip_no_clusters(ops):
    if tuple(ops.device.compute_capability) < (9, 0):
        pytest.skip("thread block clusters need sm_90")


@pytest.mark.parametrize("H,Hk,dh,lengths,S", DECODE[:1] + DECODE[3:] + [(32, 4, 128, [512, 511, 513, 1023], 1024),
                                                                        (32, 4, 128, [2, 31, 33, 200], 256)])
def test_attention_decode_cluster_equals_split_k_of_16(ops, rng, H, Hk, dh, lengths, S):
    """strata_attention_decode_cl_*: the split-K over 16 splits and its combine in one launch, partials through
    the cluster's shared memory; bit for bit the split-K kernel at num_splits 16 then the combine, whatever
    the lengths (short rows leave splits empty, G from 1 to 16, Dh 64 to 256, mixed batches), and within the
    reference's tolerance."""
    skip_no_clusters(ops)
    q, k_cache, v_cache, lengths, ref = decode_case(rng, H, Hk, dh, lengths, S)
    got = ops.attention_decode(q, k_cache, v_cache, lengths, cluster=True)
    want = ops.attention_decode(q, k_cache, v_cache, lengths, num_splits=16)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert_heads_close(got, ref, H)


@pytest.mark.parametrize("H,Hk,dh", [(32, 4, 128), (16, 2, 256)])
def test_attention_decode_cluster_rows_by_bases_window_ring_and_vram(ops, rng, H, Hk, dh):
    """The cluster kernel reads cells as the split-K kernel does: rows of several sequences (bases), a window
    over a ring of cells (the drafter's), --kv-resident's VRAM window; each the split-K-of-16 bits."""
    skip_no_clusters(ops)
    N, S = 3, 700
    _, k_cache, v_cache, _, _ = decode_case(rng, H, Hk, dh, [S] * N, S)
    seqs, lengths = np.array([2, 0, 2, 1]), np.array([700, 1, 333, 64], np.int32)
    q = rng.standard_normal((4, H, dh)).astype(np.float32)
    for kw in ({"bases": seqs * S},):
        got = ops.attention_decode(q, k_cache, v_cache, lengths, cluster=True, **kw)
        want = ops.attention_decode(q, k_cache, v_cache, lengths, num_splits=16, **kw)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    R = 256                                               # a ring of R cells, rows past it reading their last 200
    kr, vr = random_cache(rng, (1, R, Hk, dh)), random_cache(rng, (1, R, Hk, dh))
    ring_lengths = np.array([1000], np.int32)
    qr = q[:1]
    got = ops.attention_decode(qr, kr, vr, ring_lengths, cluster=True, window=200, ring=R)
    want = ops.attention_decode(qr, kr, vr, ring_lengths, num_splits=16, window=200, ring=R)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    length, ring_cells, rows = 900, 512, 3
    k1, v1 = random_cache(rng, (1, length + 3, Hk, dh)), random_cache(rng, (1, length + 3, Hk, dh))
    lens = np.arange(length - rows + 1, length + 1, dtype=np.int32)
    qv = rng.standard_normal((rows, H, dh)).astype(np.float32)
    bases = np.zeros(rows, np.int32)
    want = ops.attention_decode(qv, k1, v1, lens, bases=bases, num_splits=16)
    ring = (window_ring(k1[0], length, ring_cells), window_ring(v1[0], length, ring_cells))
    lo = max(0, length + rows - 1 - (ring_cells - KV_VRAM_SLACK))
    k1[0, lo:], v1[0, lo:] = F16_NAN, F16_NAN
    got = ops.attention_decode(qv, k1, v1, lens, bases=bases, vram=ring, cluster=True)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
