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
from strata.config import KV_VRAM_SLACK
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


def decode_inputs(rng, fmt: str, B: int, H: int, Hk: int, dh: int, S: int, lengths):
    """q [B, H, dh] and fmt's K and V planes [B, S, Hk, ...] of random heads, each sequence's scales past
    its length NaN (a kernel that reads them poisons its row) -> (q, K planes, V planes)."""
    kc, vc = kvq.codecs(fmt)
    k, v = heads(rng, (B, S, Hk, dh)), rng.standard_normal((B, S, Hk, dh)).astype(np.float32)
    kp, vp = kc.encode(k), vc.encode(v)
    for _, scales in (kp, vp):
        for b, n in enumerate(lengths):
            scales[b, n:] = F16_NAN
    return rng.standard_normal((B, H, dh)).astype(np.float32), kp, vp


def check_decode(kvops, rng, fmt: str, B: int, H: int, Hk: int, dh: int, S: int, splits=None, lengths=None) -> None:
    kc, vc = kvq.codecs(fmt)
    if lengths is None:
        lengths = rng.integers(1, S + 1, B).astype(np.int32)
        lengths[0] = S
    lengths = np.asarray(lengths, np.int32)
    q, kp, vp = decode_inputs(rng, fmt, B, H, Hk, dh, S, lengths)
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


@pytest.mark.parametrize("fmt", ["int8", "q4_0", "k8v4"])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_decode_ring_equals_registers(kvops, rng, fmt, splits):
    """At Dh 128 on sm_90 the split-K decode stages tiles through a cp.async ring in shared memory
    (kernels.decode_quant_shared); without those bytes it keeps a tile a warp in registers. Both read
    the same bytes into the same registers, so the outputs are equal bit for bit: lengths around the
    32-cell warp tiles and the ring's 2-4 tiles a warp, splits of 1,024 cells and more (shorter ones
    keep to registers: DecodeQ::RING_FROM) beside shorter ones, and cells past each length that are NaN."""
    from strata.backends.cuda.kernels import decode_quant_shared
    if not decode_quant_shared(fmt, 128, kvops.ops.device.compute_capability):
        pytest.skip("the ring is for GPUs of 228 KB of shared memory a multiprocessor (sm_90, sm_100)")
    lengths = np.array([1, 31, 32, 33, 127, 128, 129, 500, 1000, 2049, 4099], np.int32)
    q, kp, vp = decode_inputs(rng, fmt, len(lengths), 32, 4, 128, 4099, lengths)
    ring = kvops.attention_decode(fmt, q, kp, vp, lengths, num_splits=splits)
    regs = kvops.attention_decode(fmt, q, kp, vp, lengths, num_splits=splits, staged=False)
    assert np.array_equal(ring.view(np.uint32), regs.view(np.uint32))


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

    from strata.backends.cuda.kernels import decode_quant_shared
    ring_bytes = decode_quant_shared(fmt, dh, ops.device.compute_capability)

    def run(rows, q_ptr, len_ptr, base_ptr, shared=ring_bytes):
        part_acc, part_ml = ops._output(rows * H * splits * dh * 4), ops._output(rows * H * splits * 2 * 4)
        out = ops._output(rows * H * dh * 4)
        ops._launch("attention_decode_quant", (splits, Hk, rows),
                    (q_ptr, *(p.ptr for p in planes), len_ptr, base_ptr, part_acc.ptr, part_ml.ptr, H, Hk, 0,
                     splits, scale, 0, 0, 0, 0, 0, 0, 0), shared, fmt=fmt, dh=dh, g=gp)
        ops._launch("attention_combine", (H, rows), (part_acc.ptr, part_ml.ptr, out.ptr, H, dh, splits))
        return ops._download(out, (rows, H * dh), np.float32)

    got = run(T, q_dev.ptr, len_dev.ptr, base_dev.ptr)
    if ring_bytes:      # the cp.async ring and a tile a warp in registers: the same bits
        regs = run(T, q_dev.ptr, len_dev.ptr, base_dev.ptr, shared=0)
        assert np.array_equal(regs.view(np.uint32), got.view(np.uint32)), fmt
    for t in range(T):
        one = run(1, q_dev.ptr + 4 * t * H * dh, len_dev.ptr + 4 * t, base_dev.ptr + 4 * t)
        assert np.array_equal(one[0].view(np.uint32), got[t].view(np.uint32)), (fmt, t)
        n, b0 = lengths[t], bases[t]
        keys = kc.decode(kp[0][b0:b0 + n], kp[1][b0:b0 + n]).astype(np.float64)
        vals = vc.decode(vp[0][b0:b0 + n], vp[1][b0:b0 + n]).astype(np.float64)
        ref = causal_attention(qk[t][None].astype(np.float64), keys, vals, np.array([n - 1]))[0].reshape(H, dh)
        err = np.abs(got[t].reshape(H, dh) - ref).max(axis=-1)
        assert np.all(err <= TOL * np.abs(ref).max(axis=-1) + 1e-6), (fmt, t, err.max())


# ---- the fused step kernels: strata_qk_norm_rope_kv_<fmt> (cuda/decode_fused.cu) and
# strata_attention_decode_combine_rot_f32 (cuda/attention.cu), bit for bit the launches they replace

def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def check_fused_append(kvops, rng, fmt: str, T: int, H: int, Hk: int, dh: int, with_cells: bool = True) -> None:
    """strata_qk_norm_rope_kv_<fmt> against the unfused chain it replaces in a decode step:
    strata_rms_norm_f32 and strata_rope_f32 on q and k, strata_hadamard_f32 on q where K is rotated,
    strata_kv_append_<codec> of k and v: q_out and all four planes (cells not written keep their
    bytes) bit for bit, the planes also strata.quant.kv's encoding of the chain's k and v. Rows at
    different positions and cells (cells null: the positions); each row of the launch equals its own
    one-row launch (row-invariant)."""
    from strata.backends import rope
    from strata.backends.cuda.kv import rot_scale
    ops, (kc, vc) = kvops.ops, kvq.codecs(fmt)
    eps, rot = 1e-6, rot_scale(dh)
    inv, scale = rope.inv_freq(dh, 1e6, None, 262144)
    rows = 3 * T + 5
    positions = rng.choice(200000, T, replace=False).astype(np.int32)
    cells = rng.choice(rows, T, replace=False).astype(np.int32)
    if not with_cells:
        rows = int(positions.max()) + 1
        cells = positions
    q = heads(rng, (T, H, dh)) * rng.uniform(0.1, 10.0, (T, H, 1)).astype(np.float32)
    k = heads(rng, (T, Hk, dh)) * rng.uniform(0.1, 10.0, (T, Hk, 1)).astype(np.float32)
    v = heads(rng, (T, Hk, dh))
    qw, kw = (rng.uniform(-2.0, 2.0, dh).astype(np.float32) for _ in range(2))
    init = []
    for codec in (kc, vc):
        values, scales = codec.empty((rows, Hk), dh)
        values[:] = rng.integers(0, 100, values.shape).astype(values.dtype)
        scales[:] = 7.0
        init += [values, scales]
    dev = {name: ops._upload(np.ascontiguousarray(a)) for name, a in
           (("q", q), ("k", k), ("v", v), ("qw", qw), ("kw", kw), ("pos", positions), ("cells", cells),
            ("inv", np.asarray(inv, np.float32)))}

    def planes():
        return [ops._upload(a) for a in init]

    def download(bufs):
        return [ops._download(b, a.shape, a.dtype) for b, a in zip(bufs, init)]

    # the unfused chain
    qn, kn = ops._output(q.nbytes), ops._output(k.nbytes)
    for x, w, out, heads_ in (("q", "qw", qn, H), ("k", "kw", kn, Hk)):
        ops._launch("rms_norm", T * heads_, (dev[x], dev[w], out, T * heads_, dh, eps))
        ops._launch("rope", T, (out, dev["pos"], dev["inv"], T, heads_, dh, float(scale)))
    if kc.rotated:
        ops._launch("hadamard", T * H, (qn, T * H, dh, rot))
    chain = planes()
    for x, codec, (values, scales) in ((kn, kc, chain[:2]), (dev["v"], vc, chain[2:])):
        extra = (rot,) if codec.rotated else ()
        ops._launch(f"kv_append_{codec.name}", (T, Hk), (x, dev["cells"], values, scales, T, Hk, dh, *extra))
    q_chain = ops._download(qn, q.shape, np.float32)
    k_chain = ops._download(kn, k.shape, np.float32)
    want = download(chain)

    def fused(t0, n):
        q_out, bufs = ops._output(n * H * dh * 4), planes()
        grid = (n, -(-(H + 2 * Hk) // 4))
        ops._launch("qk_norm_rope_kv_quant", grid,
                    (dev["q"].ptr + 4 * t0 * H * dh, dev["k"].ptr + 4 * t0 * Hk * dh, dev["v"].ptr + 4 * t0 * Hk * dh,
                     dev["qw"], dev["kw"], dev["pos"].ptr + 4 * t0, dev["cells"].ptr + 4 * t0 if with_cells else 0,
                     dev["inv"], q_out, *bufs, n, H, Hk, dh, eps, float(scale), rot), fmt=fmt)
        return ops._download(q_out, (n, H, dh), np.float32), download(bufs)

    q_got, got = fused(0, T)
    assert np.array_equal(_bits(q_got), _bits(q_chain)), (fmt, "q")
    for i, (a, b) in enumerate(zip(got, want)):
        assert np.array_equal(_bits(a), _bits(b)), (fmt, "plane", i)
    ref = [a.copy() for a in init]
    ref[0][cells], ref[1][cells] = kc.encode(k_chain)
    ref[2][cells], ref[3][cells] = vc.encode(v)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert np.array_equal(_bits(a), _bits(b)), (fmt, "reference plane", i)
    for t in range(T) if T > 1 else ():
        q_one, one = fused(t, 1)
        assert np.array_equal(_bits(q_one[0]), _bits(q_got[t])), (fmt, t)
        c = cells[t]
        for a, b in zip(one, got):
            assert np.array_equal(_bits(a[c]), _bits(b[c])), (fmt, t)


def check_combine_rot(kvops, rng, B: int, H: int, dh: int, splits: int) -> None:
    """strata_attention_decode_combine_rot_f32 = strata_attention_decode_combine_f32 then
    strata_hadamard_f32 over the B * H head outputs, bit for bit (empty splits included)."""
    from strata.backends.cuda.kv import rot_scale
    ops = kvops.ops
    acc = rng.standard_normal((B, H, splits, dh)).astype(np.float32)
    ml = np.stack([rng.uniform(-20, 20, (B, H, splits)), rng.uniform(0.5, 50, (B, H, splits))], -1).astype(np.float32)
    ml[:, :, 1::3, 0], ml[:, :, 1::3, 1] = -np.inf, 0.0            # splits past the end
    acc_dev, ml_dev = ops._upload(acc), ops._upload(ml)
    plain, rot = ops._output(B * H * dh * 4), ops._output(B * H * dh * 4)
    ops._launch("attention_combine", (H, B), (acc_dev, ml_dev, plain, H, dh, splits))
    ops._launch("hadamard", B * H, (plain, B * H, dh, rot_scale(dh)))
    ops._launch("attention_combine_rot", (H, B), (acc_dev, ml_dev, rot, H, dh, splits, rot_scale(dh)))
    a, b = ops._download(plain, (B, H, dh), np.float32), ops._download(rot, (B, H, dh), np.float32)
    assert np.isfinite(b).all()
    assert np.array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("fmt", ["int8", "q4_0", "k8v4"])
@pytest.mark.parametrize("dh", [64, 128, 256])
@pytest.mark.parametrize("T, H, Hk", [(1, 32, 4), (3, 16, 2), (8, 32, 4), (5, 6, 6)])
def test_fused_append_equals_the_unfused_chain(kvops, rng, fmt, dh, T, H, Hk):
    check_fused_append(kvops, rng, fmt, T, H, Hk, dh)


@pytest.mark.parametrize("fmt", ["int8", "q4_0", "k8v4"])
def test_fused_append_at_the_positions_without_cells(kvops, rng, fmt):
    check_fused_append(kvops, rng, fmt, 4, 8, 2, 128, with_cells=False)


@pytest.mark.parametrize("B, H, dh, splits", [(1, 32, 128, 66), (3, 8, 64, 1), (2, 4, 256, 7), (8, 32, 128, 1024)])
def test_combine_rot_equals_combine_then_hadamard(kvops, rng, B, H, dh, splits):
    check_combine_rot(kvops, rng, B, H, dh, splits)


@pytest.mark.parametrize("fmt", ["int8", "q4_0", "k8v4"])
@pytest.mark.parametrize("H, Hk, dh", [(32, 4, 128), (8, 8, 64), (16, 2, 256)])
@pytest.mark.parametrize("length, ring_cells", [(5000, 1024), (5000, 333), (700, 2048), (1024, 1024)])
def test_decode_vram_window_bitwise(kvops, rng, fmt, H, Hk, dh, length, ring_cells):
    """--kv-resident: the newest ring_cells cells read from the ring planes (cell c at c % ring_cells),
    the cache's copies of them NaN-scaled, so a cell read from the wrong place fails; the bits equal
    the same launch over the whole cache."""
    kc, vc = kvq.codecs(fmt)
    S = length + 5
    k, v = heads(rng, (1, S, Hk, dh)), rng.standard_normal((1, S, Hk, dh)).astype(np.float32)
    kp, vp = kc.encode(k), vc.encode(v)
    q = rng.standard_normal((1, H, dh)).astype(np.float32)
    lengths = np.array([length], np.int32)
    want = kvops.attention_decode(fmt, q, kp, vp, lengths)
    lo = max(0, length - ring_cells)

    def ring(plane):
        r = np.zeros((ring_cells,) + plane.shape[2:], plane.dtype)
        for c in range(lo, length):
            r[c % ring_cells] = plane[0, c]
        return r
    rings = (tuple(ring(p) for p in kp), tuple(ring(p) for p in vp))
    near = max(0, length - (ring_cells - KV_VRAM_SLACK))     # what VramWindow reads from the ring
    for _, scales in (kp, vp):
        scales[0, near:] = F16_NAN
    for _, scales in rings:         # 8 rejected speculative rows' cells: the slack's slots, never read
        scales[np.arange(length, length + 8) % ring_cells] = F16_NAN
    got = kvops.attention_decode(fmt, q, kp, vp, lengths, vram=rings)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
