"""strata_moe_gate_up_<q> and strata_moe_down_<q> (cuda/moe_decode.cu) against float64 and against
the path they replace (GEMV per slot + swiglu + moe_combine), bit for bit.

Reference: each expert's matrices dequantized by strata.quant.dequant, products in float64:
h = silu(gate . x) * (up . x), out[t] = sum_a w * (down . h). Tolerance: ||y - ref|| / ||ref|| <
1e-5, as the GEMV tests (float32 accumulation; measured GEMV errors are at most 1.2e-6, and silu
adds a few ulp). The norm runs over at least MIN_OUTPUTS outputs (small cases repeat with fresh
inputs). Experts are separate allocations at random 16-byte pads (scattered addresses), some in
pinned host memory read over the bus; ids repeat experts. Outputs are poisoned with NaN first.
"""

import numpy as np
import pytest

from strata.quant import QTYPES, qtype
from strata.quant.dequant import dequantize
from strata.quant.random import random_qtensor_bytes

pytestmark = pytest.mark.gpu

RTOL = 1e-5
MIN_OUTPUTS = 64


class Experts:
    """E random experts of one layer: gate, up [I, D] and down [D, I] in one blob each, at offsets
    with gaps of garbage (or up right after gate when fused)."""

    def __init__(self, q, E, I, D, rng, fused=True):
        qt = qtype(q)
        self.q, self.I, self.D = q, I, D
        gate_bytes, down_bytes = I * qt.row_bytes(D), D * qt.row_bytes(I)
        align = lambda n: -(-n // 16) * 16  # noqa: E731
        self.gate_off = 16 * int(rng.integers(0, 4))
        self.up_off = self.gate_off + gate_bytes if fused else align(self.gate_off + gate_bytes) + 16
        self.down_off = align(self.up_off + gate_bytes) + 16 * int(rng.integers(0, 3))
        self.parts, self.blobs = [], []
        for _ in range(E):
            std = float(rng.uniform(0.01, 0.1))
            parts = {"gate": random_qtensor_bytes(q, (I, D), rng, std), "up": random_qtensor_bytes(q, (I, D), rng, std),
                     "down": random_qtensor_bytes(q, (D, I), rng, std)}
            blob = rng.integers(0, 256, self.down_off + down_bytes, dtype=np.uint8)
            for name, off in (("gate", self.gate_off), ("up", self.up_off), ("down", self.down_off)):
                blob[off:off + parts[name].size] = parts[name]
            self.parts.append(parts)
            self.blobs.append(blob)
        self._f64 = {}

    def matrix(self, e, name) -> np.ndarray:
        if (e, name) not in self._f64:
            shape = (self.D, self.I) if name == "down" else (self.I, self.D)
            self._f64[e, name] = dequantize(self.q, self.parts[e][name], shape).astype(np.float64)
        return self._f64[e, name]

    def ref_gate_up(self, ids, x, A):
        h = np.empty((ids.size, self.I))
        for s, e in enumerate(ids):
            g = self.matrix(e, "gate") @ x[s // A].astype(np.float64)
            u = self.matrix(e, "up") @ x[s // A].astype(np.float64)
            h[s] = g / (1 + np.exp(-g)) * u
        return h

    def ref_down(self, ids, h, w, A):
        out = np.zeros((ids.size // A, self.D))
        for s, e in enumerate(ids):
            out[s // A] += float(w[s]) * (self.matrix(e, "down") @ h[s].astype(np.float64))
        return out


def rel_err(y, ref) -> float:
    return float(np.linalg.norm(y.astype(np.float64) - ref) / np.linalg.norm(ref))


def routing(rng, T, A, E):
    """ids [T * A] with repeats across tokens and within one, weights in (0.05, 1)."""
    ids = rng.integers(0, E, T * A).astype(np.int32)
    if T * A > 1:
        ids[-1] = ids[0]
    return ids, rng.uniform(0.05, 1.0, T * A).astype(np.float32)


def check_case(mo, rng, ex: Experts, T, A, host=(), **launch):
    """Both kernels on fresh inputs, repeated until MIN_OUTPUTS outputs each; asserts the tolerance."""
    E, I, D, q = len(ex.blobs), ex.I, ex.D, ex.q
    hs, h_refs, outs, out_refs = [], [], [], []
    pads = 16 * rng.integers(0, 256, E)
    for _ in range(-(-MIN_OUTPUTS // (T * min(A * I, D)))):
        ids, w = routing(rng, T, A, E)
        x = rng.standard_normal((T, D)).astype(np.float32)
        h = mo.moe_gate_up(q, ex.blobs, ex.gate_off, ex.up_off, ids, x, A, I, D, host=host, pads=pads, **launch)
        assert h.shape == (T * A, I) and np.isfinite(h).all()
        hs.append(h.reshape(-1))
        h_refs.append(ex.ref_gate_up(ids, x, A).reshape(-1))
        h_in = rng.standard_normal((T * A, I)).astype(np.float32)
        out = mo.moe_down(q, ex.blobs, ex.down_off, ids, h_in, w, A, D, I, host=host, pads=pads, **launch)
        assert out.shape == (T, D) and np.isfinite(out).all()
        outs.append(out.reshape(-1))
        out_refs.append(ex.ref_down(ids, h_in, w, A).reshape(-1))
    for what, y, ref in (("gate_up", hs, h_refs), ("down", outs, out_refs)):
        err = rel_err(np.concatenate(y), np.concatenate(ref))
        assert err < RTOL, f"{what} {q} T {T} A {A} I {I} D {D}: rel err {err:.2e}"


def awkward_cases(q):
    """(T, A, I, D, fused, host experts): one-block rows, rows not a multiple of a row set, every T and A."""
    bs = QTYPES[q].block_size
    if bs == 1:  # n % 8 != 0 takes single-weight units, n % 8 == 0 the 8-weight ones
        return [(1, 1, 1, 1, True, ()), (3, 2, 13, 7, False, (0,)), (2, 8, 8, 24, True, (1,)),
                (8, 5, 5, 96, False, ()), (5, 3, 24, 13, True, (2,))]
    return [(1, 1, bs, bs, True, ()), (3, 2, bs, 3 * bs, False, (0,)), (2, 8, 3 * bs, bs, True, (1,)),
            (8, 5, 2 * bs, 5 * bs, False, ()), (6, 7, bs, 2 * bs, True, (2, 3)), (4, 4, 5 * bs, bs, True, ())]


@pytest.fixture(scope="module")
def mo():
    from strata.backends.cuda.moe_decode import MoeDecodeOps

    return MoeDecodeOps()


@pytest.mark.parametrize("q", list(QTYPES))
def test_awkward_sizes_match_float64(mo, rng, q):
    for T, A, I, D, fused, host in awkward_cases(q):
        check_case(mo, rng, Experts(q, A + 2, I, D, rng, fused), T, A, host)


@pytest.mark.parametrize("q", list(QTYPES))
def test_production_sizes_match_float64(mo, rng, q):
    """Qwen3-30B-A3B: D 2048, I 768, A 8, fused gate|up, T 1 and 4 (T 4 with two experts in host memory)."""
    ex = Experts(q, 10, 768, 2048, rng)
    check_case(mo, rng, ex, 1, 8)
    check_case(mo, rng, ex, 4, 8, host=(3, 7))


@pytest.mark.parametrize("q,I,D", [("Q8_0", 64, 11264), ("Q4_K", 1536, 512), ("Q4_K", 256, 2304),
                                   ("Q6_K", 512, 8192), ("IQ4_XS", 256, 9216), ("F16", 16, 4104),
                                   ("BF16", 2056, 32)])
def test_unstaged_and_streaming_paths(mo, rng, q, I, D):
    """x too big for the 48 KB of shared memory (read from global memory instead), and rows longer
    than a lane holds in registers (x read per unit): other code paths, same contract."""
    check_case(mo, rng, Experts(q, 9, I, D, rng), 2, 8, host=(0,))


def current_path(ops, ex: Experts, ids, x, h_in, w, A):
    """The replaced decode path on the GPU: one GEMV per slot and matrix (same rows, lanes and
    units as strata_moe_gemv), strata_swiglu_f32, strata_moe_combine_f32 with a zero residual."""
    I, D, q, T = ex.I, ex.D, ex.q, x.shape[0]
    gate = np.stack([ops.gemv(q, ex.parts[e]["gate"], (I, D), x[s // A]) for s, e in enumerate(ids)])
    up = np.stack([ops.gemv(q, ex.parts[e]["up"], (I, D), x[s // A]) for s, e in enumerate(ids)])
    y = np.stack([ops.gemv(q, ex.parts[e]["down"], (D, I), h_in[s]) for s, e in enumerate(ids)])
    return ops.swiglu(gate, up), ops.moe_combine(np.zeros((T, D), np.float32), y.reshape(T, A, D), w.reshape(T, A))


@pytest.mark.parametrize("q", list(QTYPES))
def test_bitwise_equal_to_current_path(mo, rng, q):
    bs = QTYPES[q].block_size
    for T, A, I, D in [(2, 3, 3 * max(bs, 8), 5 * max(bs, 8)), (4, 8, 768, 2048)] + ([(3, 2, 13, 7)] if bs == 1 else []):
        ex = Experts(q, A + 1, I, D, rng)
        ids, w = routing(rng, T, A, A + 1)
        x = rng.standard_normal((T, D)).astype(np.float32)
        h_in = rng.standard_normal((T * A, I)).astype(np.float32)
        h_ref, out_ref = current_path(mo.ops, ex, ids, x, h_in, w, A)
        h = mo.moe_gate_up(q, ex.blobs, ex.gate_off, ex.up_off, ids, x, A, I, D, host=(0,))
        out = mo.moe_down(q, ex.blobs, ex.down_off, ids, h_in, w, A, D, I, host=(0,))
        assert np.array_equal(h, h_ref), f"gate_up {q} {(T, A, I, D)}: {np.count_nonzero(h != h_ref)} values differ"
        assert np.array_equal(out, out_ref), f"down {q} {(T, A, I, D)}: {np.count_nonzero(out != out_ref)} differ"


@pytest.mark.parametrize("q", ["Q4_K", "Q8_0", "Q6_K", "IQ4_NL", "BF16"])
def test_deterministic_for_every_grid(mo, rng, q):
    """Repeated launches, and launches over any number of blocks, give the same bits."""
    T, A, I, D = 3, 8, 768, 2048
    ex = Experts(q, 12, I, D, rng)
    ids, w = routing(rng, T, A, 12)
    x = rng.standard_normal((T, D)).astype(np.float32)
    h_in = rng.standard_normal((T * A, I)).astype(np.float32)
    runs = [(mo.moe_gate_up(q, ex.blobs, ex.gate_off, ex.up_off, ids, x, A, I, D, gx=gx),
             mo.moe_down(q, ex.blobs, ex.down_off, ids, h_in, w, A, D, I, gx=gx)) for gx in (None, None, 1, 7, 5000)]
    for h, out in runs[1:]:
        assert np.array_equal(h.view(np.uint32), runs[0][0].view(np.uint32))
        assert np.array_equal(out.view(np.uint32), runs[0][1].view(np.uint32))


@pytest.mark.parametrize("q", ["Q4_K", "Q8_0", "Q6_K", "Q4_0", "F32"])
def test_routing_in_gate_up_is_moe_route_then_gate_up_bit_for_bit(mo, rng, q):
    """strata_moe_gate_up_route_<q> (route-in-moe): every block routes its token with cuda/route.cuh's code,
    so ids and weights equal strata_moe_route_f32's and h equals strata_moe_gate_up_<q>'s over them, bit for
    bit, at any grid (gx 1: one block a token; 5000: blocks with no rows route too), E of 128, 60 and 512,
    renormalized or not; logits with ties (the lower id first) and a NaN row entry."""
    bs = max(QTYPES[q].block_size, 8)
    I0, D0 = (768, 2048) if bs > 8 else (64, 256)           # the 30B's rows in a quant type (128 copies)
    for T, A, E, I, D, norm in [(1, 8, 128, I0, D0, True), (4, 8, 128, 3 * bs, 5 * bs, False),
                                (3, 4, 60, 2 * bs, 3 * bs, True), (2, 8, 512, bs, 2 * bs, True)]:
        ex = Experts(q, 5, I, D, rng)
        blobs = [ex.blobs[e % 5] for e in range(E)]            # E table entries over 5 distinct experts
        logits = rng.standard_normal((T, E)).astype(np.float32)
        logits[0, 7] = logits[0, 3] = logits[0].max() + 1       # a tie at the top: id 3 first
        if T > 2:
            logits[2, 11] = np.nan
        x = rng.standard_normal((T, D)).astype(np.float32)
        ids_ref, w_ref = mo.ops.moe_route(logits, A, norm)
        h_ref = mo.moe_gate_up(q, blobs, ex.gate_off, ex.up_off, ids_ref.reshape(-1), x, A, I, D, host=(1,))
        for gx in (None, 1, 5000):
            h, ids, w = mo.moe_gate_up_route(q, blobs, ex.gate_off, ex.up_off, logits, x, A, I, D, norm, host=(1,),
                                             gx=gx)
            case = f"{q} T {T} A {A} E {E} gx {gx}"
            assert np.array_equal(ids, ids_ref), case
            assert np.array_equal(w.view(np.uint32), w_ref.view(np.uint32)), case
            assert np.array_equal(h.view(np.uint32), h_ref.view(np.uint32)), case


def test_launch_shapes():
    from strata.backends.cuda.moe_decode import MAX_SHARED_BYTES, down_launch, gate_up_launch

    g = gate_up_launch("Q4_K", 1, 8, 768, 2048)
    assert g.grid == (264, 1, 1) and g.shared_bytes == 4 * 2048 // 64 * 68 and g.signature == "PqqPPPiii"
    d = down_launch("Q4_K", 4, 8, 2048, 768)
    assert d.grid[1:] == (4, 1) and d.shared_bytes == 4 * 8 * 768 // 64 * 68 and d.signature == "PqPPPPiii"
    assert down_launch("Q4_K", 1, 8, 4096, 1536).shared_bytes == 0 < 4 * 8 * 1536 // 64 * 68 - MAX_SHARED_BYTES


def test_rejects_bad_input(mo, rng):
    from strata.errors import InvalidArgument

    ex = Experts("Q8_0", 2, 32, 64, rng)
    x = np.ones((1, 64), np.float32)
    with pytest.raises(InvalidArgument, match="A <= 8"):
        mo.moe_gate_up("Q8_0", ex.blobs, ex.gate_off, ex.up_off, np.zeros(9, np.int32), x, 9, 32, 64)
    with pytest.raises(InvalidArgument, match="multiples of 16"):
        mo.moe_gate_up("Q8_0", ex.blobs, 8, ex.up_off, np.zeros(2, np.int32), x, 2, 32, 64)
    with pytest.raises(InvalidArgument, match="ids"):
        mo.moe_gate_up("Q8_0", ex.blobs, ex.gate_off, ex.up_off, np.full(2, 5, np.int32), x, 2, 32, 64)
