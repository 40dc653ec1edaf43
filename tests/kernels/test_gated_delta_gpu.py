"""cuda/gated_delta.cu (Qwen3-Next's DeltaNet decode step) against float64 references.

Tolerances, f32: the conv step sums K products in numpy's order without FMA, so its pre-activation
matches the f32 reference to a rounding or two and SiLU (expf, within 2 ulp) keeps it within rel 1e-6
of float64. The delta step accumulates Dk products per column twice (the prediction, then the output)
in f32 with FMA: error ~ Dk ulp of the largest term; bound atol 1e-6 * (Dk + 8) * max(1, max|S|).
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops():
    from strata.backends.cuda.testing import CudaOps
    return CudaOps()


def conv_ref(x, state, w):
    xx = np.concatenate([state, x[None]]).astype(np.float64)          # [K, C]
    acc = np.einsum("kc,ck->c", xx, w.astype(np.float64))
    return acc / (1 + np.exp(-acc)), xx[1:]


def step_ref(q, k, v, g, beta, S):
    Hv, Hg, Dk = v.shape[0], q.shape[0], q.shape[1]
    q, k = (np.repeat(a.astype(np.float64) / np.sqrt((a.astype(np.float64) ** 2).sum(-1, keepdims=True) + 1e-6),
                      Hv // Hg, axis=0) for a in (q, k))
    q = q / np.sqrt(Dk)
    S = S.astype(np.float64) * np.exp(g.astype(np.float64))[:, None, None]
    d = beta[:, None] * (v - np.einsum("hkv,hk->hv", S, k))
    S = S + k[:, :, None] * d[:, None, :]
    return np.einsum("hkv,hk->hv", S, q), S


# (C, K): 1 channel, primes, not a multiple of the 256-thread block, Qwen3-Next-80B's 8192, K of 2..4
@pytest.mark.parametrize("C,K", [(1, 4), (7, 2), (257, 3), (1000, 4), (8192, 4), (12289, 4)])
def test_conv1d_step(ops, rng, C, K):
    from strata.backends.cuda.linear_attn import gdn_conv1d_step
    x, state = rng.standard_normal(C).astype(np.float32), rng.standard_normal((K - 1, C)).astype(np.float32)
    w = (0.5 * rng.standard_normal((C, K))).astype(np.float32)
    out, new = gdn_conv1d_step(ops, x, state, w)
    want, want_state = conv_ref(x, state, w)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(new, want_state.astype(np.float32))


@pytest.mark.parametrize("T,C,K", [(1, 1, 4), (3, 7, 2), (64, 257, 4), (130, 8192, 4), (17, 12289, 3)])
def test_prompt_conv1d_equals_its_steps_bit_for_bit(ops, rng, T, C, K):
    """The prompt kernel and T step kernels: same order of the same roundings, so equal bits."""
    from strata.backends.cuda.linear_attn import gdn_conv1d, gdn_conv1d_step
    x, state = rng.standard_normal((T, C)).astype(np.float32), rng.standard_normal((K - 1, C)).astype(np.float32)
    w = (0.5 * rng.standard_normal((C, K))).astype(np.float32)
    out, new = gdn_conv1d(ops, x, state, w)
    s, rows = state, []
    for t in range(T):
        y, s = gdn_conv1d_step(ops, x[t], s, w)
        rows.append(y)
    np.testing.assert_array_equal(out, np.stack(rows))
    np.testing.assert_array_equal(new, s)
    want, _ = conv_ref(x[0], state, w)
    np.testing.assert_allclose(out[0], want, rtol=1e-6, atol=1e-6)


# (Hv, Hg, Dk, Dv): ones, primes, Dv past one 128-column block, GQA ratios 1..3, the 80B's 32/16/128/128,
# the largest Dk the kernel takes
@pytest.mark.parametrize("Hv,Hg,Dk,Dv", [(1, 1, 1, 1), (3, 3, 7, 5), (6, 2, 33, 129), (4, 4, 64, 257),
                                         (32, 16, 128, 128), (2, 1, 256, 64)])
def test_gdn_step(ops, rng, Hv, Hg, Dk, Dv):
    from strata.backends.cuda.linear_attn import gdn_step
    q, k = rng.standard_normal((2, Hg, Dk)).astype(np.float32)
    v = rng.standard_normal((Hv, Dv)).astype(np.float32)
    g, beta = -rng.uniform(0.01, 3, Hv).astype(np.float32), rng.uniform(0.05, 1, Hv).astype(np.float32)
    S = rng.standard_normal((Hv, Dk, Dv)).astype(np.float32)
    out, new = gdn_step(ops, q, k, v, g, beta, S)
    want, want_S = step_ref(q, k, v, g, beta, S)
    tol = 1e-6 * (Dk + 8) * max(1.0, np.abs(S).max())
    np.testing.assert_allclose(out, want, rtol=0, atol=tol)
    np.testing.assert_allclose(new, want_S, rtol=0, atol=tol)


def test_gdn_steps_chain_like_the_cpu_recurrence(ops, rng):
    """Twenty steps with the state kept between them equal the numpy recurrence over 20 tokens."""
    from strata.backends.cpu_linear_attn import gated_delta_recurrent, l2_normalize
    from strata.backends.cuda.linear_attn import gdn_step
    Hv, Hg, Dk, Dv, T = 8, 4, 64, 32, 20
    q, k = rng.standard_normal((2, T, Hg, Dk)).astype(np.float32)
    v = rng.standard_normal((T, Hv, Dv)).astype(np.float32)
    g, beta = -rng.uniform(0.01, 1, (T, Hv)).astype(np.float32), rng.uniform(0.05, 1, (T, Hv)).astype(np.float32)
    S = np.zeros((Hv, Dk, Dv), np.float32)
    outs = []
    for t in range(T):
        o, S = gdn_step(ops, q[t], k[t], v[t], g[t], beta[t], S)
        outs.append(o)
    qh = np.repeat(l2_normalize(q), 2, axis=1) * np.float32(Dk ** -0.5)
    want, want_S = gated_delta_recurrent(qh, np.repeat(l2_normalize(k), 2, axis=1), v, g, beta,
                                         np.zeros_like(S))
    np.testing.assert_allclose(np.stack(outs), want, rtol=0, atol=1e-4)
    np.testing.assert_allclose(S, want_S, rtol=0, atol=1e-4)


@pytest.mark.parametrize("T,Hv,Hg,Dk,Dv", [(1, 1, 1, 1, 1), (7, 6, 2, 33, 129), (64, 32, 16, 128, 128),
                                           (130, 4, 4, 256, 64)])
def test_prompt_delta_rule_equals_its_steps_bit_for_bit(ops, rng, T, Hv, Hg, Dk, Dv):
    """strata_gdn_prompt_f32 does strata_gdn_step_f32's arithmetic in its order: equal bits."""
    from strata.backends.cuda.linear_attn import gdn_prompt, gdn_step
    q, k = rng.standard_normal((2, T, Hg, Dk)).astype(np.float32)
    v = rng.standard_normal((T, Hv, Dv)).astype(np.float32)
    g, beta = -rng.uniform(0.01, 1, (T, Hv)).astype(np.float32), rng.uniform(0.05, 1, (T, Hv)).astype(np.float32)
    S0 = rng.standard_normal((Hv, Dk, Dv)).astype(np.float32)
    out, new = gdn_prompt(ops, q, k, v, g, beta, S0)
    S, rows = S0, []
    for t in range(T):
        o, S = gdn_step(ops, q[t], k[t], v[t], g[t], beta[t], S)
        rows.append(o)
    np.testing.assert_array_equal(out, np.stack(rows))
    np.testing.assert_array_equal(new, S)


# ---- the gates of Qwen3-Next's GPU layers (strata_gdn_gates_f32, strata_sigmoid_mul_f32,
# strata_rope_partial_f32) against float64: expf / log1pf / sincosf within a few ulp, so rel 1e-5

@pytest.mark.parametrize("T,Hg,r", [(1, 1, 1), (5, 2, 2), (300, 16, 2)])
def test_gdn_gates(ops, rng, T, Hg, r):
    Hv = Hg * r
    ba = (3 * rng.standard_normal((T, Hg, 2 * r))).astype(np.float32)
    a = -np.exp(rng.uniform(-1, 2, Hv)).astype(np.float32)
    dt = rng.standard_normal(Hv).astype(np.float32)
    g_dev, b_dev = ops._output(T * Hv * 4), ops._output(T * Hv * 4)
    ins = [ops._upload(x) for x in (ba, a, dt)]
    ops._launch("gdn_gates", -(-T * Hv // 256), (*ins, g_dev, b_dev, T, Hg, r))
    g, beta = ops._download(g_dev, (T, Hv), np.float32), ops._download(b_dev, (T, Hv), np.float32)
    x = ba.astype(np.float64)
    b, alpha = x[..., :r].reshape(T, Hv), x[..., r:].reshape(T, Hv)
    np.testing.assert_allclose(g, a * np.logaddexp(0, alpha + dt), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(beta, 1 / (1 + np.exp(-b)), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rows,n,per_row", [(1, 1, False), (7, 300, False), (70000, 3, True), (9, 2048, True)])
def test_sigmoid_mul(ops, rng, rows, n, per_row):
    x = rng.standard_normal((rows, n)).astype(np.float32)
    gate = (3 * rng.standard_normal((rows, 1 if per_row else n))).astype(np.float32)
    out = ops._output(x.nbytes)
    ins = [ops._upload(a) for a in (x, gate)]
    ops._launch("sigmoid_mul", (-(-n // 256), min(rows, 65535)), (*ins, out, rows, n, gate.shape[1], 0 if per_row else 1))
    got = ops._download(out, (rows, n), np.float32)
    np.testing.assert_allclose(got, x * (1 / (1 + np.exp(-gate.astype(np.float64)))), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("T,heads,dh,rot", [(1, 1, 16, 4), (9, 4, 256, 64), (5, 3, 24, 12), (3, 2, 64, 64)])
def test_rope_partial(ops, rng, T, heads, dh, rot):
    from strata.backends import rope
    x = rng.standard_normal((T, heads, dh)).astype(np.float32)
    pos = rng.integers(0, 4000, T).astype(np.int32)
    inv, _ = rope.inv_freq(rot, 1e7, None, 4096)
    inv = inv.astype(np.float32)
    buf = ops._upload(x)
    ins = [ops._upload(a) for a in (pos, inv)]
    ops._launch("rope_partial", T, (buf, *ins, T, heads, dh, rot, 1.0))
    got = ops._download(buf, x.shape, np.float32)
    cos, sin = rope.cos_sin(pos.astype(np.int64), inv, 1.0)
    want = x.copy()
    want[..., :rot] = rope.apply(x[..., :rot].astype(np.float64), cos, sin)
    np.testing.assert_array_equal(got[..., rot:], x[..., rot:])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ---- the row kernels of a batched step of parallel slots (each row's states at its own address) ----

@pytest.mark.parametrize("R,C,K", [(1, 7, 2), (3, 257, 4), (8, 8192, 4)])
def test_conv1d_rows_equal_each_rows_own_step_bit_for_bit(ops, rng, R, C, K):
    """strata_gdn_conv1d_rows_f32 runs strata_gdn_conv1d_step_f32's code per row over the state at
    row_states[r] (laid out in reverse row order): equal bits, out and states."""
    from strata.backends.cuda.linear_attn import gdn_conv1d_rows, gdn_conv1d_step
    x, states = rng.standard_normal((R, C)).astype(np.float32), rng.standard_normal((R, K - 1, C)).astype(np.float32)
    w = (0.5 * rng.standard_normal((C, K))).astype(np.float32)
    out, new = gdn_conv1d_rows(ops, x, states, w)
    for r in range(R):
        y, s = gdn_conv1d_step(ops, x[r], states[r], w)
        np.testing.assert_array_equal(out[r], y)
        np.testing.assert_array_equal(new[r], s)


@pytest.mark.parametrize("R,Hv,Hg,Dk,Dv", [(1, 3, 3, 7, 5), (3, 6, 2, 33, 129), (4, 32, 16, 128, 128),
                                           (8, 2, 1, 256, 64)])
def test_gdn_step_rows_equal_each_rows_own_step_bit_for_bit(ops, rng, R, Hv, Hg, Dk, Dv):
    """strata_gdn_step_rows_f32 runs strata_gdn_step_f32's code per row over the state at row_states[r]:
    equal bits, out and states (the 80B's shape among them)."""
    from strata.backends.cuda.linear_attn import gdn_step, gdn_step_rows
    q, k = rng.standard_normal((2, R, Hg, Dk)).astype(np.float32)
    v = rng.standard_normal((R, Hv, Dv)).astype(np.float32)
    g, beta = -rng.uniform(0.01, 3, (R, Hv)).astype(np.float32), rng.uniform(0.05, 1, (R, Hv)).astype(np.float32)
    states = rng.standard_normal((R, Hv, Dk, Dv)).astype(np.float32)
    out, new = gdn_step_rows(ops, q, k, v, g, beta, states)
    for r in range(R):
        o, s = gdn_step(ops, q[r], k[r], v[r], g[r], beta[r], states[r])
        np.testing.assert_array_equal(out[r], o)
        np.testing.assert_array_equal(new[r], s)
