"""cuda/kv_quant.cu's q4r staging in the tensor-core decode (strata_attention_decode_q4_0 / _k8v4), modelled
on the host: the tile a warp stages in shared memory (its cp.async chunks and Q4Tile's swizzle), the
ldmatrix reads out of it (the PTX ISA's m8n8 b16 fragment layout, plain and .trans) and the scale reads,
against the direct global loads they replace (each lane's 4-byte K words, its 2-byte V pieces paired by
__byte_perm(.., 0x5410), its scale loads). Every lane must get the same bytes in the same register for
every tile, sub-tile, block and cell past the end (zeros), so the MMAs see the same operands and the
outputs stay bit for bit; every ldmatrix must be free of bank conflicts and the staged buffers must fit
the warp's acc_s region within the 48 KB of static shared memory. The index formulas are the kernel's,
transcribed; the GPU tests (tests/kernels/test_kv_quant_gpu.py) run the kernels themselves."""
import numpy as np
import pytest

K_WARPS = 4


def geometry(dh: int) -> dict:
    nsub = 2 if dh <= 128 else 1
    row = dh // 2                       # q4r value bytes per head vector (Plane<true>::ROW, Q4Tile::ROW)
    cpr = row // 16
    return {"NSUB": nsub, "TILE": 16 * nsub, "ROW": row, "CPR": cpr, "RP": 8 // cpr, "NB": dh // 32,
            "SB": dh // 16}


def chunk(geo: dict, c: int, b: int) -> int:
    """Q4Tile::chunk: the byte offset of (cell c, block b) in a staged tile."""
    return c * geo["ROW"] + 16 * (b ^ ((c // geo["RP"]) % geo["CPR"]))


def stage(geo: dict, rows: np.ndarray, scales: np.ndarray, n_valid: int) -> tuple[bytearray, bytearray]:
    """The stage lambda for one plane: lane l copies chunks l, l + 32, .. and the scales of cell l;
    cells at or past n_valid are zero-filled (src-size 0). rows [TILE, ROW] uint8, scales [TILE, SB] uint8."""
    tile, cpr, row, sb = geo["TILE"], geo["CPR"], geo["ROW"], geo["SB"]
    vals, scl = bytearray(tile * row), bytearray(tile * sb)
    written = set()
    for lane in range(32):
        for i in range(tile * cpr // 32):
            ch = lane + 32 * i
            c, blk = ch // cpr, ch % cpr
            dst = chunk(geo, c, blk)
            assert dst % 16 == 0 and dst not in written
            written.add(dst)
            vals[dst:dst + 16] = rows[c, blk * 16:blk * 16 + 16].tobytes() if c < n_valid else bytes(16)
        if lane < tile:
            scl[lane * sb:(lane + 1) * sb] = scales[lane].tobytes() if lane < n_valid else bytes(sb)
    assert len(written) == tile * cpr
    return vals, scl


def u32(buf, off: int) -> int:
    return int.from_bytes(bytes(buf[off:off + 4]), "little")


def u16(buf, off: int) -> int:
    return int.from_bytes(bytes(buf[off:off + 2]), "little")


def ldmatrix_x4(buf, addrs: list[int], trans: bool) -> list[list[int]]:
    """r[lane][m] of ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16, addrs[lane] the row address that lane
    gives (lanes 8m .. 8m + 7: rows 0..7 of matrix m). Plain: lane (g, t) gets b16 2t, 2t + 1 of row g;
    .trans: b16 g of rows 2t and 2t + 1 (the lower half the first of each pair)."""
    out = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        regs = []
        for m in range(4):
            rows = addrs[8 * m:8 * m + 8]
            if trans:
                regs.append(u16(buf, rows[2 * t] + 2 * g) | u16(buf, rows[2 * t + 1] + 2 * g) << 16)
            else:
                regs.append(u32(buf, rows[g] + 4 * t))
        out.append(regs)
    return out


def assert_conflict_free(addrs: list[int]) -> None:
    """Each 8 x 8 matrix's 8 rows of 16 bytes in 8 distinct 16-byte groups of the 32 banks."""
    for m in range(4):
        groups = {(a % 128) // 16 for a in addrs[8 * m:8 * m + 8]}
        assert len(groups) == 8, addrs[8 * m:8 * m + 8]


@pytest.mark.parametrize("dh", [64, 128, 256])
@pytest.mark.parametrize("n_valid", [None, 1, 9, 17, 31])
def test_staged_fragments_equal_the_direct_loads(dh, n_valid):
    geo = geometry(dh)
    tile, nsub, nb, row, sb = geo["TILE"], geo["NSUB"], geo["NB"], geo["ROW"], geo["SB"]
    n_valid = tile if n_valid is None else min(n_valid, tile)
    rng = np.random.default_rng(dh + n_valid)
    k_rows, v_rows = (rng.integers(0, 256, (tile, row), dtype=np.uint8) for _ in range(2))
    k_scl, v_scl = (rng.integers(0, 256, (tile, sb), dtype=np.uint8) for _ in range(2))
    kbuf, ks_buf = stage(geo, k_rows, k_scl, n_valid)
    vbuf, vs_buf = stage(geo, v_rows, v_scl, n_valid)

    def direct(rows, c, off, n):   # load_raw<n>(row of cell c + off, c < n_valid)
        return int.from_bytes(rows[c, off:off + n].tobytes(), "little") if c < n_valid else 0

    for sub in range(nsub):
        # K: kq[nt][kb] of lane (g, t) = the 4-byte load of cell sub*16 + nt*8 + g at kb*16 + 4t
        kq = [[[None] * nb for _ in range(2)] for _ in range(32)]
        for j in range(2 * nb // 4):
            addrs = []
            for lane in range(32):
                mi = 4 * j + (lane >> 3)
                addrs.append(chunk(geo, sub * 16 + mi // nb * 8 + (lane & 7), mi % nb))
            assert_conflict_free(addrs)
            for lane, regs in enumerate(ldmatrix_x4(kbuf, addrs, trans=False)):
                for mm in range(4):
                    kq[lane][(4 * j + mm) // nb][(4 * j + mm) % nb] = regs[mm]
        # V: vq[pr][vb] = __byte_perm(vw[2pr][vb], vw[2pr + 1][vb], 0x5410), vw[ci] the 2-byte load of
        # cell sub*16 + (ci >> 1)*8 + 2t + (ci & 1) at vb*16 + 2g
        vq = [[[None] * nb for _ in range(2)] for _ in range(32)]
        for j in range(2 * nb // 4):
            addrs = []
            for lane in range(32):
                mi = 4 * j + (lane >> 3)
                addrs.append(chunk(geo, sub * 16 + mi // nb * 8 + (lane & 7), mi % nb))
            assert_conflict_free(addrs)
            for lane, regs in enumerate(ldmatrix_x4(vbuf, addrs, trans=True)):
                for mm in range(4):
                    vq[lane][(4 * j + mm) // nb][(4 * j + mm) % nb] = regs[mm]
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for nt in range(2):
                for kb in range(nb):
                    assert kq[lane][nt][kb] == direct(k_rows, sub * 16 + nt * 8 + g, kb * 16 + 4 * t, 4)
            for pr in range(2):
                for vb in range(nb):
                    lo = direct(v_rows, sub * 16 + pr * 8 + 2 * t, vb * 16 + 2 * g, 2)
                    hi = direct(v_rows, sub * 16 + pr * 8 + 2 * t + 1, vb * 16 + 2 * g, 2)
                    assert vq[lane][pr][vb] == lo | hi << 16
            # the scales of cells 2t, 2t + 1, 8 + 2t, 9 + 2t (ci), read where they are used
            for ci in range(4):
                c = sub * 16 + (ci >> 1) * 8 + 2 * t + (ci & 1)
                assert bytes(ks_buf[c * sb:(c + 1) * sb]) == (k_scl[c].tobytes() if c < n_valid else bytes(sb))
                assert bytes(vs_buf[c * sb:(c + 1) * sb]) == (v_scl[c].tobytes() if c < n_valid else bytes(sb))


@pytest.mark.parametrize("dh, gps", [(64, (1, 2, 4, 8, 16)), (128, (1, 2, 4, 8, 16)), (256, (1, 2, 4, 8))])
@pytest.mark.parametrize("fmt", ["q4_0", "k8v4"])
def test_staged_buffers_fit(dh, gps, fmt):
    """Two buffers a warp in its acc_s region (WREG floats); the kernel's static shared memory under 48 KB."""
    geo = geometry(dh)
    kq4 = fmt == "q4_0"
    tile, row, sb = geo["TILE"], geo["ROW"], geo["SB"]
    buf = (tile * row + tile * sb) * (2 if kq4 else 1)       # [K values][V values][K scales][V scales]
    assert buf % 16 == 0 and (tile * row) % 16 == 0
    for gp in gps:
        wreg = max(gp * dh, buf // 2)
        npass = 1 if gp <= 8 else 2
        static = 4 * K_WARPS * wreg + (dh // 16) * npass * 32 * 16 + K_WARPS * gp * 2 * 4 + gp * 4
        assert 4 * wreg >= 2 * buf and static <= 48 * 1024, (fmt, dh, gp, static)
