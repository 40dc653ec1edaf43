"""Lane-level numpy emulation of cuda/kv_quant.cu's tensor-core decode (one warp over one split), mirroring
its fragment indices (k_dim, v_dim, the cells of each lane, hi/lo stacking, V's scale exponent in the
codes) and PTX's m16n8k16 fragment layouts, against float64 attention. A check of the index mapping on
a machine without a GPU; slow (pure Python per lane), small sizes only. The byte-level conversions
(__byte_perm, nibble pairs) are not emulated: codes are read by dim.

    python tools/kv_decode_emulate.py int8,q4_0,k8v4
"""
import sys

import numpy as np

from strata.quant import kv as kvq

f16 = np.float16

def mma(c, A, B):
    """c[lane][4] += A(16x16) B(16x8) given per-lane fragments A[lane][8 halves], B[lane][4 halves] (PTX layout)."""
    Am = np.zeros((16, 16)); Bm = np.zeros((16, 8))
    for ln in range(32):
        g, t = ln >> 2, ln & 3
        a = A[ln]; b = B[ln]
        Am[g, 2*t], Am[g, 2*t+1] = a[0], a[1]
        Am[g+8, 2*t], Am[g+8, 2*t+1] = a[2], a[3]
        Am[g, 2*t+8], Am[g, 2*t+9] = a[4], a[5]
        Am[g+8, 2*t+8], Am[g+8, 2*t+9] = a[6], a[7]
        Bm[2*t, g], Bm[2*t+1, g] = b[0], b[1]
        Bm[2*t+8, g], Bm[2*t+9, g] = b[2], b[3]
    D = Am @ Bm
    for ln in range(32):
        g, t = ln >> 2, ln & 3
        c[ln][0] += D[g, 2*t]; c[ln][1] += D[g, 2*t+1]; c[ln][2] += D[g+8, 2*t]; c[ln][3] += D[g+8, 2*t+1]

def k_dim(Q4, j, t, e):
    if Q4: return (j >> 1) * 32 + t * 8 + 2 * (j & 1) + (e >> 1) + 4 * (e & 1)
    return (j >> 2) * 64 + t * 16 + (j & 3) * 4 + e

def v_dim(Q4, bv, ii, n): return bv*32 + n*4 + ii if Q4 else bv*64 + n*8 + ii

def nib(byte, hi): return ((byte >> 4) if hi else (byte & 15)) - 8

def kcode(Q4, kvals, cell, dim):  # the lane's conversion, emulated through its bytes: code of dim
    if Q4:
        byte = int(kvals[cell, dim // 2]); return nib(byte, dim & 1)
    return int(kvals[cell, dim])

def emulate(fmt, q, kp, vp, n, scale, GP, DH):
    kc, vc = kvq.codecs(fmt); KQ4, VQ4 = kc.name == 'q4r', vc.name == 'q4r'
    G = q.shape[0]
    STACK = GP <= 8; NPASS = 1 if STACK else 2; NH = 1 if STACK else 2
    NSLICE = DH // 16; KBS = 32 if KQ4 else 64; VBS = 32 if VQ4 else 64
    KNB, VNB = DH // KBS, DH // VBS; SPB = KBS // 16; NTB = VBS // 8; NT = DH // 8
    KMAX = 27 if VQ4 else 24
    kv_, ks = kp; vv, vs = vp
    qs = np.zeros((GP, DH), np.float32); qs[:G] = q * np.float32(scale * 1.4426950408889634)
    qexp = []
    for h in range(GP):
        mx = np.abs(qs[h]).max(); x = np.frexp(mx)[1]
        qexp.append(max(-60, min(60, 14 - x)) if mx > 0 else 0)
    # fragments
    qfrag = [[None]*32 for _ in range(NSLICE*NPASS)]
    for slice_ in range(NSLICE):
        for pss in range(NPASS):
            for fl in range(32):
                fg, ft = fl >> 2, fl & 3
                r = [None]*4
                for half in range(2):
                    for row in range(2):
                        h = fg if STACK else fg + 8*row
                        comp = row if STACK else pss
                        v = []
                        for i in range(2):
                            x = np.float32(0)
                            if h < GP: x = np.float32(np.ldexp(qs[h, k_dim(KQ4, slice_, ft, 2*half+i)], qexp[h]))
                            hi = f16(x)
                            v.append(hi if comp == 0 else f16(x - np.float32(hi)))
                        r[2*half+row] = v
                # A halves a0..a7 = r0 (a0,a1), r1 (a2,a3), r2 (a4,a5), r3 (a6,a7)
                qfrag[slice_*NPASS+pss][fl] = [float(z) for rr in r for z in rr]
    acc = [[[0.0]*4 for _ in range(NT)] for _ in range(32)]
    m = [[-np.inf]*NH for _ in range(32)]; l = [[0.0]*NH for _ in range(32)]
    TILE = 32 if DH <= 128 else 16; NSUB = TILE // 16
    for c0 in range(0, n, TILE):
        S = [None] * NSUB
        for sub in range(NSUB):
            base = c0 + sub*16
            # scores
            sacc = [[[0.0]*4 for _ in range(NH)] for _ in range(32)]
            for kb in range(KNB):
                c = [[[0.0]*4 for _ in range(32)] for _ in range(2)]
                for jj in range(SPB):
                    slice_ = kb*SPB + jj
                    for pss in range(NPASS):
                        for nt in range(2):
                            B = []
                            for ln in range(32):
                                g, t = ln >> 2, ln & 3
                                cell = base + nt*8 + g
                                if cell < n: B.append([kcode(KQ4, kv_, cell, k_dim(KQ4, slice_, t, e)) for e in range(4)])
                                else: B.append([0]*4)
                            mma(c[nt], qfrag[slice_*NPASS+pss], B)
                for ln in range(32):
                    g, t = ln >> 2, ln & 3
                    for ci in range(4):
                        nt, j = ci >> 1, ci & 1
                        cell = base + nt*8 + 2*t + j
                        d = float(ks[cell, kb]) if cell < n else 0.0
                        if STACK: sacc[ln][0][ci] += d * (c[nt][ln][j] + c[nt][ln][2+j])
                        else:
                            for h in range(NH): sacc[ln][h][ci] += d * c[nt][ln][2*h+j]
            S[sub] = sacc
        # softmax
        V = {}
        for ln in range(32):
            g, t = ln >> 2, ln & 3
            for h in range(NH):
                head = g + 8*h
                inv = 2.0 ** -qexp[head] if head < GP else 1.0
                vals = []
                for sub in range(NSUB):
                    for ci in range(4):
                        cell = c0 + sub*16 + (ci >> 1)*8 + 2*t + (ci & 1)
                        vals.append(S[sub][ln][h][ci]*inv if cell < n else -np.inf)
                V[(ln, h)] = vals
        for ln in range(32):
            g, t = ln >> 2, ln & 3
            for h in range(NH):
                mx = max(max(V[(4*g+tt, h)]) for tt in range(4))
                m_new = max(m[ln][h], mx); alpha = 2.0 ** (m[ln][h] - m_new) if m[ln][h] > -np.inf else 0.0
                ps = [2.0 ** (x - m_new) if x > -np.inf else 0.0 for x in V[(ln, h)]]
                l[ln][h] = l[ln][h]*alpha + sum(ps); m[ln][h] = m_new
                for nn in range(NT):
                    if STACK: acc[ln][nn] = [a*alpha for a in acc[ln][nn]]
                    else:
                        acc[ln][nn][2*h] *= alpha; acc[ln][nn][2*h+1] *= alpha
                for sub in range(NSUB):
                    for ci in range(4):
                        PP.setdefault(ln, {})[(sub, h, ci)] = ps[sub*4+ci]
        for sub in range(NSUB):
            base = c0 + sub*16
            for vb in range(VNB):
                A = {pss: [] for pss in range(NPASS)}; e5s = []
                for ln in range(32):
                    g, t = ln >> 2, ln & 3
                    mant = []; e5 = []
                    for ci in range(4):
                        cell = base + (ci >> 1)*8 + 2*t + (ci & 1)
                        dv = vs[cell, vb] if cell < n else f16(0)
                        bits = int(np.array(dv, f16).view(np.uint16))
                        e = min(max((bits >> 10) & 31, 1), KMAX)
                        e5.append(e); mant.append(np.float32(dv) * np.float32(2.0 ** (15 - e)))
                    e5s.append(e5)
                    def sp(x):
                        x = np.float32(x); hi = f16(x); return float(hi), float(f16(x - np.float32(hi)))
                    if STACK:
                        x = [np.float32(PP[ln][(sub, 0, ci)]) * mant[ci] for ci in range(4)]
                        h0, l0 = sp(x[0]); h1, l1 = sp(x[1]); h2, l2 = sp(x[2]); h3, l3 = sp(x[3])
                        A[0].append([h0, h1, l0, l1, h2, h3, l2, l3])
                    else:
                        xs = [[np.float32(PP[ln][(sub, h, ci)]) * mant[ci] for ci in range(4)] for h in range(2)]
                        spl = [[sp(xs[h][ci]) for ci in range(4)] for h in range(2)]
                        for pss in range(2):
                            A[pss].append([spl[0][0][pss], spl[0][1][pss], spl[1][0][pss], spl[1][1][pss],
                                           spl[0][2][pss], spl[0][3][pss], spl[1][2][pss], spl[1][3][pss]])
                for ii in range(NTB):
                    B = []
                    for ln in range(32):
                        g, t = ln >> 2, ln & 3
                        dim = v_dim(VQ4, vb, ii, g)
                        row = []
                        for ci in range(4):
                            cell = base + (ci >> 1)*8 + 2*t + (ci & 1)
                            code = kcode(VQ4, vv, cell, dim) if cell < n else 0
                            row.append(float(f16(code * 2.0 ** (e5s[ln][ci] - 15))))
                        B.append(row)
                    for pss in range(NPASS):
                        mma_acc = [acc[ln][vb*NTB+ii] for ln in range(32)]
                        mma(mma_acc, A[pss], B)
    out = np.zeros((GP, DH)); L = np.zeros(GP); M = np.zeros(GP)
    for ln in range(32):
        g, t = ln >> 2, ln & 3
        for h in range(NH):
            head = g + 8*h
            if head >= GP: continue
            for nn in range(NT):
                for j in range(2):
                    out[head, v_dim(VQ4, nn // NTB, nn % NTB, 2*t + j)] = acc[ln][nn][j] + acc[ln][nn][2+j] if STACK else acc[ln][nn][2*h+j]
            L[head] += l[ln][h]; M[head] = m[ln][h]
    return (out / L[:, None])[:G]

PP = {}
def run(fmt, G, DH, n, seed=0):
    global PP; PP = {}
    rng = np.random.default_rng(seed)
    kc, vc = kvq.codecs(fmt)
    k = rng.standard_normal((n, DH)).astype(np.float32); k[:, 5] *= 30
    v = rng.standard_normal((n, DH)).astype(np.float32) * np.float32(rng.choice([1e-3, 1, 50]))
    q = rng.standard_normal((G, DH)).astype(np.float32)
    kp, vp = kc.encode(k), vc.encode(v)
    qr = kvq.rotate(q) if kc.rotated else q
    GP = 1 << (G - 1).bit_length()
    got = emulate(fmt, qr, kp, vp, n, 1 / np.sqrt(DH), GP, DH)
    keys = kc.decode(*kp).astype(np.float64); vals = vc.decode(*vp).astype(np.float64)
    s = qr.astype(np.float64) @ keys.T / np.sqrt(DH)
    p = np.exp(s - s.max(1, keepdims=True)); ref = (p @ vals) / p.sum(1, keepdims=True)
    err = np.abs(got - ref).max(1) / np.abs(ref).max(1)
    print(fmt, G, DH, n, 'max rel err', err.max(), 'OK' if err.max() < 1e-5 else 'FAIL')

for fmt in (sys.argv[1] if len(sys.argv) > 1 else 'int8,q4_0,k8v4').split(','):
    for G, DH, n in [(8, 128, 37), (16, 64, 21), (3, 64, 50), (8, 256, 19), (1, 128, 5)]:
        run(fmt, G, DH, n)
