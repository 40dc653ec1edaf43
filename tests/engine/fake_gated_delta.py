"""numpy emulations of cuda/gated_delta.cu (and rope.cu's partial RoPE) for tests/engine/fake_cuda.py (the references of
strata.backends.cpu_linear_attn, over the fake device memory), with the launch shapes checked."""
import numpy as np

from strata.backends.cpu_linear_attn import causal_conv1d, gated_delta_recurrent, l2_normalize, sigmoid, softplus
from tests.engine.fake_cuda import view


def emulate_conv1d_step(grid, x, state, w, out, C, K):
    assert grid[0] * 256 >= C and grid[1] == grid[2] == 1
    s = view(state, (K - 1) * C).reshape(K - 1, C)
    y, s_new = causal_conv1d(view(x, C)[None].copy(), s.copy(), view(w, C * K).reshape(C, K))
    s[:] = s_new
    view(out, C)[:] = y[0]


def emulate_conv1d(grid, x, state, w, out, T, C, K, x_ld):
    assert grid[0] * 256 >= C and grid[1] == grid[2] == 1 and 1 <= K <= 8
    s = view(state, (K - 1) * C).reshape(K - 1, C)
    xs = np.stack([view(x + t * x_ld * 4, C) for t in range(T)])
    y, s_new = causal_conv1d(xs, s.copy(), view(w, C * K).reshape(C, K))
    s[:] = s_new
    view(out, T * C)[:] = y.reshape(-1)


def emulate_gdn_step(grid, q, k, v, g, beta, state, out, Hv, Hg, Dk, Dv, q_scale):
    assert grid[0] * 128 >= Dv and grid[1] == Hv and 0 < Dk <= 256 and Hv % Hg == 0
    r = Hv // Hg
    qh = np.repeat(l2_normalize(view(q, Hg * Dk).reshape(Hg, Dk)), r, axis=0) * np.float32(q_scale)
    kh = np.repeat(l2_normalize(view(k, Hg * Dk).reshape(Hg, Dk)), r, axis=0)
    S = view(state, Hv * Dk * Dv).reshape(Hv, Dk, Dv)
    o, S_new = gated_delta_recurrent(qh[None], kh[None], view(v, Hv * Dv).reshape(1, Hv, Dv),
                                     view(g, Hv)[None], view(beta, Hv)[None], S)
    S[:] = S_new
    view(out, Hv * Dv)[:] = o.reshape(-1)


def emulate_gdn_prompt(grid, q, k, v, g, beta, state, out, T, Hv, Hg, Dk, Dv, q_scale, qk_ld, v_ld):
    assert grid[0] * 128 >= Dv and grid[1] == Hv and 0 < Dk <= 256 and Hv % Hg == 0
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
