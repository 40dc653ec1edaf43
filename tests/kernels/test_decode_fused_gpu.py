"""cuda/decode_fused.cu against float64 numpy references and against the launches each kernel replaces.

- strata_add_rms_norm_f32: x_out is the f32 sum bit for bit; out within rel 1e-5 of float64 (the
  bound of tests/kernels/test_rms_norm.py); and bit-identical to strata_add_f32 + strata_rms_norm_f32,
  whose thread mapping and reduction it shares.
- strata_qk_norm_rope_kv_f32: q within 2e-5 * (|ref| + max|ref|) of float64 (the QK-norm + RoPE bound
  of test_rope_gpu.py; cos/sin from the same f32 angle, sincosf ~1 ulp); K cells within one f16
  rounding (2^-11 relative) plus that f32 error; V cells exactly v.astype(float16); every other cell
  untouched.
- strata_gemv3_<qtype>: equal to three strata_gemv_<qtype> (batch 1) or strata_gemv_batch_<qtype>
  launches, and within rel 1e-5 of float64 (the bound of test_gemv_gpu.py).
Outputs are poisoned with 0xFF bytes (NaN) before each launch, so an element a kernel skips fails.
"""

import numpy as np
import pytest

from strata.backends import rope
from strata.quant import QTYPES
from strata.quant.dequant import dequantize
from strata.quant.random import random_qtensor_bytes

pytestmark = pytest.mark.gpu

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


class Gpu:
    """Buffers and launches on one stream, straight over strata._ext.runtime."""

    def __init__(self):
        from strata._ext import runtime
        self.rt = runtime
        self.dev = runtime.Device(0)
        self.stream = runtime.Stream(self.dev)
        self.kernels = {}

    def kernel(self, library, name, signature):
        if name not in self.kernels:
            self.kernels[name] = self.rt.load_library(library).kernel(self.dev, name, signature)
        return self.kernels[name]

    def upload(self, a):
        a = np.ascontiguousarray(a)
        buf = self.rt.DeviceBuffer(self.dev, max(a.nbytes, 16))
        buf.copy_from_host(a, self.stream)
        return buf

    def output(self, nbytes):
        buf = self.rt.DeviceBuffer(self.dev, max(nbytes, 16))
        buf.fill_bytes(0xFF, self.stream)
        return buf

    def download(self, buf, shape, dtype=np.float32):
        out = np.empty(shape, dtype)
        buf.copy_to_host(out, self.stream)
        self.stream.synchronize()
        return out

    def launch(self, library, name, signature, grid, block, args):
        self.kernel(library, name, signature).launch(grid, block, args, stream=self.stream)


@pytest.fixture(scope="module")
def gpu():
    return Gpu()


def rms_norm64(x, w, eps):
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w.astype(np.float64)


# ---- add + RMSNorm -------------------------------------------------------------------------------

# 1 row, primes, n not a multiple of 4 (the scalar path) or of the block, production D 2048, a chunk
ADD_NORM_SHAPES = [(1, 1), (1, 7), (3, 31), (5, 257), (13, 1000), (17, 4093), (1, 2048), (7, 2048), (512, 2048),
                   (2, 4096), (11, 12288)]


def add_rms_norm(gpu, x, y, w, eps, in_place=False):
    rows, n = x.shape
    xb, yb, wb = gpu.upload(x), gpu.upload(y), gpu.upload(w)
    sb = xb if in_place else gpu.output(x.nbytes)
    ob = gpu.output(x.nbytes)
    gpu.launch("decode_fused", "strata_add_rms_norm_f32", "PPPPPiif", rows, 256,
               (xb.ptr, yb.ptr, sb.ptr, wb.ptr, ob.ptr, rows, n, eps))
    return gpu.download(sb, x.shape), gpu.download(ob, x.shape)


@pytest.mark.parametrize("rows,n", ADD_NORM_SHAPES)
def test_add_rms_norm_matches_float64(gpu, rng, rows, n):
    x = (rng.standard_normal((rows, n)) * rng.uniform(0.1, 10.0, (rows, 1))).astype(np.float32)
    y = rng.standard_normal((rows, n)).astype(np.float32)
    w = rng.uniform(-2.0, 2.0, n).astype(np.float32)
    s, out = add_rms_norm(gpu, x, y, w, 1e-6)
    assert np.array_equal(s, x + y)
    np.testing.assert_allclose(out, rms_norm64(x + y, w, 1e-6), rtol=1e-5, atol=0)


# rows of up to 4096 are held in registers (kNormHeld float4s a thread), 257 is not 16-byte, 8192 and
# 4100 take the loop
@pytest.mark.parametrize("rows,n", [(1, 2048), (5, 257), (64, 2048), (1, 4096), (2, 8192), (3, 4100), (1, 1000)])
@pytest.mark.parametrize("in_place", [True, False])
def test_add_rms_norm_equals_add_then_rms_norm(gpu, rng, rows, n, in_place):
    x = rng.standard_normal((rows, n)).astype(np.float32)
    y = rng.standard_normal((rows, n)).astype(np.float32)
    w = rng.uniform(-2.0, 2.0, n).astype(np.float32)
    s, out = add_rms_norm(gpu, x, y, w, 1e-6, in_place=in_place)
    xb, yb, wb = gpu.upload(x), gpu.upload(y), gpu.upload(w)
    sb, ob = gpu.output(x.nbytes), gpu.output(x.nbytes)
    gpu.launch("add", "strata_add_f32", "PPPq", 8, 256, (xb.ptr, yb.ptr, sb.ptr, x.size))
    gpu.launch("rms_norm", "strata_rms_norm_f32", "PPPiif", rows, 256, (sb.ptr, wb.ptr, ob.ptr, rows, n, 1e-6))
    assert np.array_equal(s, gpu.download(sb, x.shape))
    assert np.array_equal(out, gpu.download(ob, x.shape))


# ---- add + RMSNorm in the router's blocks (norm-in-router) ----------------------------------------

# (tokens, n, router rows): the 30B's step and verify windows, Qwen3-Next's 512 experts, rows of 4096
@pytest.mark.parametrize("T,n,E", [(1, 2048, 128), (2, 2048, 128), (5, 2048, 128), (1, 2048, 512), (2, 4096, 64),
                                   (1, 264, 40)])
def test_add_norm_router_equals_add_rms_norm_then_router(gpu, rng, T, n, E):
    """strata_add_norm_router_f32 (cuda/gemv.cu): x_out, normed and the logits equal strata_add_rms_norm_f32 then
    strata_gemv_split_f32 (strata_gemv_rows_split_f32 for T > 1) bit for bit, at the engine's grid and others
    (any grid is complete)."""
    from strata.backends.cuda.memory import gemv_grid
    x = (rng.standard_normal((T, n)) * rng.uniform(0.1, 10.0, (T, 1))).astype(np.float32)
    y = rng.standard_normal((T, n)).astype(np.float32)
    w = rng.uniform(-2.0, 2.0, n).astype(np.float32)
    W = (rng.standard_normal((E, n)) * 0.05).astype(np.float32)
    s_ref, out_ref = add_rms_norm(gpu, x, y, w, 1e-6)
    ob, Wb, lb = gpu.upload(out_ref), gpu.upload(W), gpu.output(T * E * 4)
    grid = gemv_grid("F32", E, n) * 4
    if T == 1:
        gpu.launch("gemv", "strata_gemv_split_f32", "PPPii", grid, 128, (Wb.ptr, ob.ptr, lb.ptr, E, n))
    else:
        gpu.launch("gemv", "strata_gemv_rows_split_f32", "PPPiii", grid, 128, (Wb.ptr, ob.ptr, lb.ptr, E, n, T))
    logits_ref = gpu.download(lb, (T, E))
    xb, yb, wb = gpu.upload(x), gpu.upload(y), gpu.upload(w)
    for g in (grid, 1, 3, 4 * grid + 1):
        sb, nb, lb = gpu.output(x.nbytes), gpu.output(x.nbytes), gpu.output(T * E * 4)
        gpu.kernel("gemv", "strata_add_norm_router_f32", "PPPPPPPiiif").launch(
            g, 128, (xb.ptr, yb.ptr, sb.ptr, wb.ptr, nb.ptr, Wb.ptr, lb.ptr, E, n, T, 1e-6), T * n * 4,
            stream=gpu.stream)
        assert np.array_equal(gpu.download(sb, x.shape).view(np.uint32), s_ref.view(np.uint32)), g
        assert np.array_equal(gpu.download(nb, x.shape).view(np.uint32), out_ref.view(np.uint32)), g
        assert np.array_equal(gpu.download(lb, (T, E)).view(np.uint32), logits_ref.view(np.uint32)), g


# ---- QK-norm + RoPE + K/V append ------------------------------------------------------------------

# (T, H, Hk, Dh): one token at the production heads (Qwen3-30B-A3B: 32 / 4 / 128), Dh 64 (the demo
# model's), half a warp of pairs (Dh 62, 24), primes, Dh 256 and the largest 1024, a prompt chunk
QK_SHAPES = [(1, 32, 4, 128), (1, 32, 4, 64), (1, 4, 2, 64), (3, 5, 1, 62), (7, 32, 4, 128), (13, 7, 7, 24),
             (5, 16, 2, 256), (2, 3, 1, 1024), (1, 1, 1, 2), (128, 32, 4, 128), (33, 16, 4, 64)]


def qk_inputs(rng, T, H, Hk, dh):
    """Random q [T, H, dh], k and v [T, Hk, dh], and the q/k norm weights [dh]."""
    q = rng.standard_normal((T, H, dh)).astype(np.float32)
    k = rng.standard_normal((T, Hk, dh)).astype(np.float32)
    v = rng.standard_normal((T, Hk, dh)).astype(np.float32)
    qw, kw = rng.uniform(-2.0, 2.0, dh).astype(np.float32), rng.uniform(-2.0, 2.0, dh).astype(np.float32)
    return q, k, v, qw, kw


def qk_reference(q, k, qw, kw, positions, inv, scale, eps):
    cos, sin = rope.cos_sin(positions, inv, scale)
    return (rope.apply(rms_norm64(q, qw, eps), cos.astype(np.float64), sin.astype(np.float64)),
            rope.apply(rms_norm64(k, kw, eps), cos.astype(np.float64), sin.astype(np.float64)))


def qk_norm_rope_kv(gpu, q, k, v, qw, kw, positions, inv, scale, eps, cells, grid_y=None, in_place=False,
                    rows=None):
    """rows: the cache cell of each token (parallel slots' rows), else its position."""
    from strata.backends.cuda.kernels import KERNELS
    T, H, dh = q.shape
    Hk = k.shape[1]
    qb, kb, vb = gpu.upload(q), gpu.upload(k), gpu.upload(v)
    qwb, kwb = gpu.upload(qw), gpu.upload(kw)
    pb, ib = gpu.upload(positions.astype(np.int32)), gpu.upload(inv.astype(np.float32))
    rb = None if rows is None else gpu.upload(np.asarray(rows, np.int32))
    ob = qb if in_place else gpu.output(q.nbytes)
    kc, vc = gpu.output(cells * Hk * dh * 2), gpu.output(cells * Hk * dh * 2)
    grid = (T, grid_y or -(-(H + 2 * Hk) // 4))
    gpu.launch("decode_fused", "strata_qk_norm_rope_kv_f32", KERNELS["qk_norm_rope_kv"].signature, grid, 128,
               (qb.ptr, kb.ptr, vb.ptr, qwb.ptr, kwb.ptr, pb.ptr, 0 if rb is None else rb.ptr, ib.ptr, ob.ptr,
                kc.ptr, vc.ptr, T, H, Hk, dh, eps, scale))
    return (gpu.download(ob, q.shape), gpu.download(kc, (cells, Hk, dh), np.float16),
            gpu.download(vc, (cells, Hk, dh), np.float16))


def check_qk(got, ref):
    q_out, k_cells, v_cells, positions, v = got
    q_ref, k_ref, cells = ref
    assert np.isfinite(q_out).all()
    bound = 2e-5 * (np.abs(q_ref) + np.abs(q_ref).max())
    assert (np.abs(q_out - q_ref) <= bound).all(), f"q: max err {np.abs(q_out - q_ref).max():.3g}"
    k_got = k_cells[positions].astype(np.float64)
    k_bound = 2.0 ** -11 * np.abs(k_ref) + 2e-5 * (np.abs(k_ref) + np.abs(k_ref).max())
    assert (np.abs(k_got - k_ref) <= k_bound).all(), f"k: max err {np.abs(k_got - k_ref).max():.3g}"
    assert np.array_equal(v_cells[positions].view(np.uint16), v.astype(np.float16).view(np.uint16))
    untouched = np.setdiff1d(np.arange(cells), positions)
    for c in (k_cells, v_cells):
        assert (c[untouched].view(np.uint16) == 0xFFFF).all(), "a cell past the positions was written"


@pytest.mark.parametrize("T,H,Hk,dh", QK_SHAPES)
@pytest.mark.parametrize("scaling", [None, YARN], ids=["plain", "yarn"])
def test_qk_norm_rope_kv_matches_float64(gpu, rng, T, H, Hk, dh, scaling):
    eps = 1e-6
    inv, scale = rope.inv_freq(dh, 1e6, scaling, 262144)
    q = (rng.standard_normal((T, H, dh)) * rng.uniform(0.1, 10.0, (T, H, 1))).astype(np.float32)
    k = (rng.standard_normal((T, Hk, dh)) * rng.uniform(0.1, 10.0, (T, Hk, 1))).astype(np.float32)
    v = rng.standard_normal((T, Hk, dh)).astype(np.float32)
    qw, kw = rng.uniform(-2.0, 2.0, dh).astype(np.float32), rng.uniform(-2.0, 2.0, dh).astype(np.float32)
    cells = T + 37
    positions = rng.choice(cells, T, replace=False)          # distinct cells, any order
    got = qk_norm_rope_kv(gpu, q, k, v, qw, kw, positions, inv, scale, eps, cells)
    q_ref, k_ref = qk_reference(q, k, qw, kw, positions, inv, scale, eps)
    check_qk((*got, positions, v), (q_ref, k_ref, cells))


@pytest.mark.parametrize("T,H,Hk,dh", [(1, 32, 4, 128), (3, 32, 4, 64)])
def test_qk_norm_rope_kv_far_positions(gpu, rng, T, H, Hk, dh):
    # positions up to 40960 (Qwen3's context): the angle reaches 4e4 radians
    eps = 1e-6
    inv, scale = rope.inv_freq(dh, 1e6, None, 40960)
    q, k, v, qw, kw = qk_inputs(rng, T, H, Hk, dh)
    positions = np.sort(rng.choice(np.arange(40000, 40960), T, replace=False))
    got = qk_norm_rope_kv(gpu, q, k, v, qw, kw, positions, inv, scale, eps, 40960)
    q_ref, k_ref = qk_reference(q, k, qw, kw, positions, inv, scale, eps)
    check_qk((*got, positions, v), (q_ref, k_ref, 40960))


def test_qk_norm_rope_kv_cells_apart_from_positions(gpu, rng):
    # parallel slots' rows: RoPE at each token's position, its K/V into the cell it names (another
    # sequence's part of the cache); the same bits as writing at the position, moved
    T, H, Hk, dh, eps = 4, 32, 4, 128, 1e-6
    inv, scale = rope.inv_freq(dh, 1e6, None, 40960)
    q, k, v, qw, kw = qk_inputs(rng, T, H, Hk, dh)
    positions = np.array([5, 5, 17, 0])
    rows = np.array([105, 5, 217, 300])                     # cells of slots 1, 0, 2, 3 (100 cells each)
    q_at, k_at, v_at = qk_norm_rope_kv(gpu, q, k, v, qw, kw, positions, inv, scale, eps, 400, rows=rows)
    for t in range(T):
        one = qk_norm_rope_kv(gpu, q[t:t + 1], k[t:t + 1], v[t:t + 1], qw, kw, positions[t:t + 1], inv, scale, eps,
                              400)
        assert np.array_equal(q_at[t].view(np.uint32), one[0][0].view(np.uint32))
        assert np.array_equal(k_at[rows[t]].view(np.uint16), one[1][positions[t]].view(np.uint16))
        assert np.array_equal(v_at[rows[t]].view(np.uint16), one[2][positions[t]].view(np.uint16))
    untouched = np.setdiff1d(np.arange(400), rows)
    assert (k_at[untouched].view(np.uint16) == 0xFFFF).all()


def test_qk_norm_rope_kv_any_grid_and_in_place(gpu, rng):
    T, H, Hk, dh, eps = 5, 32, 4, 128, 1e-6
    inv, scale = rope.inv_freq(dh, 1e6, None, 40960)
    q, k, v, qw, kw = qk_inputs(rng, T, H, Hk, dh)
    positions = rng.choice(64, T, replace=False)
    full = qk_norm_rope_kv(gpu, q, k, v, qw, kw, positions, inv, scale, eps, 64)
    for grid_y, in_place in ((1, False), (3, True), (40, True)):      # warps stride over the heads
        got = qk_norm_rope_kv(gpu, q, k, v, qw, kw, positions, inv, scale, eps, 64, grid_y, in_place)
        for a, b in zip(got, full):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_qk_norm_rope_kv_equals_the_launches_it_replaces(gpu, rng):
    # rms_norm + rope of q and k, kv_append: same q to ~1 ulp (the norm's reduction order differs)
    T, H, Hk, dh, eps = 1, 32, 4, 128, 1e-6
    inv, scale = rope.inv_freq(dh, 1e6, None, 40960)
    q, k, v, qw, kw = qk_inputs(rng, T, H, Hk, dh)
    positions = np.array([17])
    fused_q, fused_k, fused_v = qk_norm_rope_kv(gpu, q, k, v, qw, kw, positions, inv, scale, eps, 32)
    pb, ib = gpu.upload(positions.astype(np.int32)), gpu.upload(inv.astype(np.float32))
    outs = []
    for x, w in ((q, qw), (k, kw)):
        xb, wb, yb = gpu.upload(x), gpu.upload(w), gpu.output(x.nbytes)
        rows = x.size // dh
        gpu.launch("rms_norm", "strata_rms_norm_f32", "PPPiif", rows, 256, (xb.ptr, wb.ptr, yb.ptr, rows, dh, eps))
        gpu.launch("rope", "strata_rope_f32", "PPPiiif", T, 128, (yb.ptr, pb.ptr, ib.ptr, T, x.shape[1], dh, scale))
        outs.append(gpu.download(yb, x.shape))
    np.testing.assert_allclose(fused_q, outs[0], rtol=2e-6, atol=2e-6 * np.abs(outs[0]).max())
    k16 = outs[1].astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(fused_k[17].astype(np.float32), k16[0], rtol=2 ** -10, atol=1e-5)
    assert np.array_equal(fused_v[17], v[0].astype(np.float16))


# ---- three GEMVs over one input -------------------------------------------------------------------

GEMV_THREADS, GEMV_BATCH_ROWS = 128, 4


def gemv3_shapes(name):
    """(rows of the three matrices, n): awkward sizes, then the production q/k/v (D 2048, H 32 /
    Hk 4 at Dh 128, and Dh 64)."""
    bs = QTYPES[name].block_size
    if bs == 1:
        return [((1, 1, 1), 7), ((13, 3, 5), 33), ((7, 1, 2), 96), ((4096, 512, 512), 2048), ((2048, 256, 256), 2048)]
    return [((1, 1, 1), bs), ((13, 3, 5), 7 * bs), ((97, 31, 2), 3 * bs), ((4096, 512, 512), 2048),
            ((2048, 256, 256), 2048)]


def gemv3(gpu, name, datas, rows, n, x, grid=None):
    from strata.backends.cuda.testing import CudaOps
    batch = x.shape[0]
    wb = [gpu.upload(d) for d in datas]
    xb = gpu.upload(x)
    yb = [gpu.output(batch * r * 4) for r in rows]
    per_set = GEMV_BATCH_ROWS if batch > 1 else CudaOps.gemv_rows_per_block(CudaOps, name, n) // 4
    sets = sum(-(-r // per_set) for r in rows)
    gpu.launch("decode_fused", f"strata_gemv3_{name.lower()}", "PPPPPPPiiiii", grid or -(-sets // 4), GEMV_THREADS,
               (*(b.ptr for b in wb), xb.ptr, *(b.ptr for b in yb), *rows, n, batch))
    return [gpu.download(b, (batch, r)) for b, r in zip(yb, rows)]


def separate(gpu, name, datas, rows, n, x):
    from strata.backends.cuda.testing import CudaOps
    batch = x.shape[0]
    xb = gpu.upload(x)
    outs = []
    for d, r in zip(datas, rows):
        wb, yb = gpu.upload(d), gpu.output(batch * r * 4)
        if batch == 1:
            grid = -(-r // CudaOps.gemv_rows_per_block(CudaOps, name, n))
            gpu.launch("gemv", f"strata_gemv_{name.lower()}", "PPPii", grid, GEMV_THREADS, (wb.ptr, xb.ptr, yb.ptr, r, n))
        else:
            gpu.launch("gemv", f"strata_gemv_batch_{name.lower()}", "PPPiii", -(-r // 16), GEMV_THREADS,
                       (wb.ptr, xb.ptr, yb.ptr, r, n, batch))
        outs.append(gpu.download(yb, (batch, r)))
    return outs


@pytest.mark.parametrize("name", list(QTYPES))
def test_gemv3_equals_separate_gemvs_and_float64(gpu, rng, name):
    for rows, n in gemv3_shapes(name):
        datas = [random_qtensor_bytes(name, (r, n), rng) for r in rows]
        w64 = [dequantize(name, d, (r, n)).astype(np.float64) for d, r in zip(datas, rows)]
        for batch in (1, 2, 5, 8):
            if batch > 1 and n % 8:
                continue                                  # the batched kernels need n % 8 == 0
            x = rng.standard_normal((batch, n)).astype(np.float32)
            ys = gemv3(gpu, name, datas, rows, n, x)
            for y, ref in zip(ys, separate(gpu, name, datas, rows, n, x)):
                assert np.array_equal(y, ref), f"{name} rows {rows} n {n} batch {batch}: differs from strata_gemv"
            ref64 = np.concatenate([(x.astype(np.float64) @ w.T).ravel() for w in w64])
            got = np.concatenate([y.ravel() for y in ys])
            if np.linalg.norm(ref64) > 0 and got.size >= 64:       # a few dot products say nothing relative
                err = np.linalg.norm(got - ref64) / np.linalg.norm(ref64)
                assert err < 1e-5, f"{name} rows {rows} n {n} batch {batch}: rel err {err:.2e}"


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "F16"])
@pytest.mark.parametrize("batch", [1, 4])
def test_gemv3_any_grid(gpu, rng, name, batch):
    rows, n = (4096, 512, 512), 2048
    datas = [random_qtensor_bytes(name, (r, n), rng) for r in rows]
    x = rng.standard_normal((batch, n)).astype(np.float32)
    full = gemv3(gpu, name, datas, rows, n, x)
    for grid in (1, 7, 5000):                           # warps stride over the concatenated row sets
        for a, b in zip(gemv3(gpu, name, datas, rows, n, x, grid), full):
            assert np.array_equal(a, b)
