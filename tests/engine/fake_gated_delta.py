"""numpy emulations of cuda/gated_delta.cu (and rope.cu's partial RoPE) for tests/engine/fake_cuda.py (the references of
strata.backends.cpu_linear_attn, over the fake device memory), with the launch shapes checked."""
import numpy as np

from strata.backends.cpu_linear_attn import (_unit_lower_inverse, causal_conv1d, gated_delta_recurrent, l2_normalize,
                                             sigmoid, softplus)
from tests.engine.fake_cuda import view


def emulate_conv1d_step(grid, x, state, w, out, C, K):
    assert grid[0] * 256 >= C and grid[1] == grid[2] == 1
    s = view(state, (K - 1) * C).reshape(K - 1, C)
    y, s_new = causal_conv1d(view(x, C)[None].copy(), s.copy(), view(w, C * K).reshape(C, K))
    s[:] = s_new
    view(out, C)[:] = y[0]


def _row_states(row_states, rows):
    """The rows' state addresses (uint64 in device memory, read when the launch runs, as a graph
    replay reads them): distinct, as the row kernels' contract asks."""
    addrs = [int(a) for a in view(row_states, rows, np.uint64)]
    assert len(set(addrs)) == rows, f"fake_cuda: rows share states at {[hex(a) for a in addrs]}"
    return addrs


def emulate_conv1d_rows(grid, x, row_states, state_off, w, out, C, K):
    """Each row the one-row step over its own state (cuda/gated_delta.cu strata_gdn_conv1d_rows_f32)."""
    assert grid[0] * 256 >= C and grid[1] >= 1 and grid[2] == 1
    for r, base in enumerate(_row_states(row_states, grid[1])):
        emulate_conv1d_step((grid[0], 1, 1), x + r * C * 4, base + state_off, w, out + r * C * 4, C, K)


def emulate_conv1d(grid, x, state, w, out, T, C, K, x_ld):
    assert grid[0] * 256 >= C and grid[1] == grid[2] == 1 and 1 <= K <= 8
    s = view(state, (K - 1) * C).reshape(K - 1, C)
    xs = np.stack([view(x + t * x_ld * 4, C) for t in range(T)])
    y, s_new = causal_conv1d(xs, s.copy(), view(w, C * K).reshape(C, K))
    s[:] = s_new
    view(out, T * C)[:] = y.reshape(-1)


def emulate_gdn_step(grid, q, k, v, g, beta, state, out, Hv, Hg, Dk, Dv, q_scale):
    assert grid[0] == -(-Dv // 32) and grid[1] == Hv and 0 < Dk <= 256 and Hv % Hg == 0
    r = Hv // Hg
    qh = np.repeat(l2_normalize(view(q, Hg * Dk).reshape(Hg, Dk)), r, axis=0) * np.float32(q_scale)
    kh = np.repeat(l2_normalize(view(k, Hg * Dk).reshape(Hg, Dk)), r, axis=0)
    S = view(state, Hv * Dk * Dv).reshape(Hv, Dk, Dv)
    o, S_new = gated_delta_recurrent(qh[None], kh[None], view(v, Hv * Dv).reshape(1, Hv, Dv),
                                     view(g, Hv)[None], view(beta, Hv)[None], S)
    S[:] = S_new
    view(out, Hv * Dv)[:] = o.reshape(-1)


def emulate_gdn_step_rows(grid, q, k, v, g, beta, row_states, state_off, out, Hv, Hg, Dk, Dv, q_scale):
    """Each row the one-row step over its own state (cuda/gated_delta.cu strata_gdn_step_rows_f32)."""
    assert grid[2] >= 1
    qk, vo = Hg * Dk * 4, Hv * Dv * 4
    for r, base in enumerate(_row_states(row_states, grid[2])):
        emulate_gdn_step((grid[0], grid[1], 1), q + r * qk, k + r * qk, v + r * vo, g + r * Hv * 4, beta + r * Hv * 4,
                         base + state_off, out + r * vo, Hv, Hg, Dk, Dv, q_scale)


def emulate_gdn_prompt(grid, q, k, v, g, beta, state, out, T, Hv, Hg, Dk, Dv, q_scale, qk_ld, v_ld):
    assert grid[0] == -(-Dv // 32) and grid[1] == Hv and 0 < Dk <= 256 and Hv % Hg == 0
    assert qk_ld >= Hg * Dk and v_ld >= Hv * Dv
    r = Hv // Hg
    rows = lambda p, ld, n: np.stack([view(p + t * ld * 4, n) for t in range(T)])   # noqa: E731
    qh = np.repeat(l2_normalize(rows(q, qk_ld, Hg * Dk).reshape(T, Hg, Dk)), r, axis=1) * np.float32(q_scale)
    kh = np.repeat(l2_normalize(rows(k, qk_ld, Hg * Dk).reshape(T, Hg, Dk)), r, axis=1)
    S = view(state, Hv * Dk * Dv).reshape(Hv, Dk, Dv)
    o, S_new = gated_delta_recurrent(qh, kh, rows(v, v_ld, Hv * Dv).reshape(T, Hv, Dv),
                                     view(g, T * Hv).reshape(T, Hv), view(beta, T * Hv).reshape(T, Hv), S)
    S[:] = S_new
    view(out, T * Hv * Dv)[:] = o.reshape(-1)


def _chunk_rows(p, ld, T, lo, width, C=64):
    """Rows lo .. lo+C of a [T, width] array at p (row stride ld), zeros past T: a chunk as the kernels stage it."""
    out = np.zeros((C, width), np.float32)
    for i in range(min(C, T - lo)):
        out[i] = view(p + (lo + i) * ld * 4, width)
    return out


def emulate_gdn_chunk_prep(grid, q, k, g, beta, scratch, T, Hv, Hg, Dk, q_scale, qk_ld):
    """cuda/gated_delta_chunk.cu's prep: per (chunk, h) M = (I + A)^-1 diag(beta), P and the row scales,
    in its scratch layout (its header)."""
    C, nc, r = 64, -(-T // 64), Hv // Hg
    assert tuple(grid) == (nc, Hv, 1) and Hv % Hg == 0 and qk_ld >= Hg * Dk and Dk >= 1
    blocks = view(scratch, nc * Hv * 8448).reshape(nc, Hv, 8448)
    for ci in range(nc):
        lo, n = ci * C, min(C, T - ci * C)
        Q, K = (np.repeat(_chunk_rows(p, qk_ld, T, lo, Hg * Dk).reshape(C, Hg, Dk), r, axis=1).transpose(1, 0, 2)
                for p in (q, k))                                          # [Hv, C, Dk], raw
        qinv = q_scale / np.sqrt(np.sum(Q * Q, axis=-1) + np.float32(1e-6))   # [Hv, C]
        kinv = 1 / np.sqrt(np.sum(K * K, axis=-1) + np.float32(1e-6))
        c = np.cumsum(_chunk_rows(g, Hv, T, lo, Hv), axis=0).T             # [Hv, C]; past n: c_last
        b = _chunk_rows(beta, Hv, T, lo, Hv).T
        valid = np.arange(C) < n
        lower = np.tril(np.ones((C, C), bool)) & valid[:, None]
        dec = np.where(lower, np.exp(np.where(lower, c[:, :, None] - c[:, None, :], 0)), 0).astype(np.float32)
        KK = K @ K.transpose(0, 2, 1)
        A = np.tril(b[:, :, None] * KK * kinv[:, :, None] * kinv[:, None, :] * dec, -1)
        P = (Q @ K.transpose(0, 2, 1)) * qinv[:, :, None] * kinv[:, None, :] * dec
        blk = blocks[ci]
        blk[:, :4096] = (_unit_lower_inverse(A) * b[:, None, :]).reshape(Hv, -1)
        blk[:, 4096:8192] = P.reshape(Hv, -1)
        cl = c[:, n - 1:n]
        blk[:, 8192:8256] = np.where(valid, qinv * np.exp(c), 0)
        blk[:, 8256:8320] = np.where(valid, kinv * np.exp(c), 0)
        blk[:, 8320:8384] = np.where(valid, kinv * np.exp(cl - c), 0)
        blk[:, 8384] = np.exp(cl[:, 0])


def emulate_gdn_chunk_scan(grid, q, k, v, scratch, state, out, T, Hv, Hg, Dk, Dv, qk_ld, v_ld):
    """cuda/gated_delta_chunk.cu's scan: the chunks in order over the prep's scratch (its header's formulas)."""
    C, nc, r = 64, -(-T // 64), Hv // Hg
    assert tuple(grid) == (-(-Dv // 16), Hv, 1) and 1 <= Dk <= 128 and v_ld >= Hv * Dv
    blocks = view(scratch, nc * Hv * 8448).reshape(nc, Hv, 8448)
    S = view(state, Hv * Dk * Dv).reshape(Hv, Dk, Dv)
    o = view(out, T * Hv * Dv).reshape(T, Hv, Dv)
    for ci in range(nc):
        lo, n = ci * C, min(C, T - ci * C)
        Q, K = (np.repeat(_chunk_rows(p, qk_ld, T, lo, Hg * Dk).reshape(C, Hg, Dk), r, axis=1).transpose(1, 0, 2)
                for p in (q, k))
        V = _chunk_rows(v, v_ld, T, lo, Hv * Dv).reshape(C, Hv, Dv).transpose(1, 0, 2)
        blk = blocks[ci]
        M, P = blk[:, :4096].reshape(Hv, C, C), blk[:, 4096:8192].reshape(Hv, C, C)
        qs, ka, kb = (blk[:, 8192 + 64 * i:8256 + 64 * i][:, :, None] for i in range(3))
        Vp = M @ (V - (K * ka) @ S)
        o[lo:lo + n] = ((Q * qs) @ S + P @ Vp).transpose(1, 0, 2)[:n]
        S[:] = S * blk[:, 8384, None, None] + (K * kb).transpose(0, 2, 1) @ Vp


def emulate_gdn_gates(grid, ba, a, dt_bias, g, beta, T, Hg, r):
    Hv = Hg * r
    assert grid[0] * 256 >= T * Hv and grid[1] == grid[2] == 1
    x = view(ba, T * Hg * 2 * r).reshape(T, Hg, 2 * r)
    b, alpha = x[..., :r].reshape(T, Hv), x[..., r:].reshape(T, Hv)
    view(g, T * Hv)[:] = (view(a, Hv) * softplus(alpha + view(dt_bias, Hv))).reshape(-1)
    view(beta, T * Hv)[:] = sigmoid(b).reshape(-1)


def emulate_sigmoid_mul(grid, x, gate, out, rows, n, gate_ld, gate_step):
    assert grid[0] * 256 >= n and 1 <= grid[1] <= 65535 and gate_step in (0, 1)
    xs = view(x, rows * n).reshape(rows, n).copy()
    last = (rows - 1) * gate_ld + (n - 1) * gate_step + 1
    gv = view(gate, last)
    idx = np.arange(rows)[:, None] * gate_ld + np.arange(n)[None, :] * gate_step
    view(out, rows * n)[:] = (xs * sigmoid(gv[idx])).reshape(-1)


def emulate_rope_partial(grid, x, pos, inv, T, heads, dh, rot, scale):
    from strata.backends import rope
    assert grid[0] >= T and rot % 2 == 0 and rot <= dh
    xs = view(x, T * heads * dh).reshape(T, heads, dh)
    cos, sin = rope.cos_sin(view(pos, T, np.int32).astype(np.int64), view(inv, rot // 2), scale)
    xs[..., :rot] = rope.apply(xs[..., :rot].copy(), cos, sin)
