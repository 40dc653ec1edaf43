"""cuda/gated_delta.cu's wrappers (strata.backends.cuda.linear_attn) on the fake runtime: signatures,
launch shapes and state round trips, against strata.backends.cpu_linear_attn."""
import numpy as np
import pytest

from strata.backends.cpu_linear_attn import causal_conv1d, gated_delta_recurrent, l2_normalize
from strata.backends.cuda.linear_attn import gdn_conv1d, gdn_conv1d_step, gdn_prompt, gdn_prompt_chunked, gdn_step
from strata.errors import InvalidArgument


@pytest.fixture
def ops(fake):
    from strata.backends.cuda.testing import CudaOps
    return CudaOps()


@pytest.mark.parametrize("C,K", [(1, 2), (257, 4), (8192, 4)])
def test_conv1d_step_advances_the_state(ops, fake, rng, C, K):
    x, state = rng.standard_normal(C).astype(np.float32), rng.standard_normal((K - 1, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    out, new = gdn_conv1d_step(ops, x, state, w)
    want, want_state = causal_conv1d(x[None], state, w)
    np.testing.assert_array_equal(out, want[0])
    np.testing.assert_array_equal(new, want_state)
    assert fake.launches[-1] == "strata_gdn_conv1d_step_f32"


@pytest.mark.parametrize("T,C,K", [(1, 3, 4), (9, 257, 4), (5, 64, 2)])
def test_prompt_conv1d_equals_its_steps(ops, fake, rng, T, C, K):
    x, state = rng.standard_normal((T, C)).astype(np.float32), rng.standard_normal((K - 1, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    out, new = gdn_conv1d(ops, x, state, w)
    assert fake.launches[-1] == "strata_gdn_conv1d_f32"
    s, rows = state, []
    for t in range(T):
        y, s = gdn_conv1d_step(ops, x[t], s, w)
        rows.append(y)
    np.testing.assert_array_equal(out, np.stack(rows))
    np.testing.assert_array_equal(new, s)


@pytest.mark.parametrize("Hv,Hg,Dk,Dv", [(1, 1, 1, 1), (4, 2, 16, 8), (6, 3, 33, 129)])
def test_gdn_step_matches_the_recurrence(ops, fake, rng, Hv, Hg, Dk, Dv):
    q, k = rng.standard_normal((2, Hg, Dk)).astype(np.float32)
    v = rng.standard_normal((Hv, Dv)).astype(np.float32)
    g, beta = -rng.uniform(0, 2, Hv).astype(np.float32), rng.uniform(0, 1, Hv).astype(np.float32)
    state = rng.standard_normal((Hv, Dk, Dv)).astype(np.float32)
    out, new = gdn_step(ops, q, k, v, g, beta, state)
    r = Hv // Hg
    qh = np.repeat(l2_normalize(q), r, axis=0) * np.float32(Dk ** -0.5)
    want, want_state = gated_delta_recurrent(qh[None], np.repeat(l2_normalize(k), r, axis=0)[None], v[None],
                                             g[None], beta[None], state)
    np.testing.assert_allclose(out, want[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(new, want_state, rtol=1e-6, atol=1e-6)
    assert fake.launches[-1] == "strata_gdn_step_f32"


@pytest.mark.parametrize("T,Hv,Hg,Dk,Dv", [(1, 1, 1, 4, 4), (9, 4, 2, 16, 8), (3, 6, 3, 33, 129)])
def test_prompt_delta_rule_equals_its_steps(ops, fake, rng, T, Hv, Hg, Dk, Dv):
    q, k = rng.standard_normal((2, T, Hg, Dk)).astype(np.float32)
    v = rng.standard_normal((T, Hv, Dv)).astype(np.float32)
    g, beta = -rng.uniform(0, 2, (T, Hv)).astype(np.float32), rng.uniform(0, 1, (T, Hv)).astype(np.float32)
    state = rng.standard_normal((Hv, Dk, Dv)).astype(np.float32)
    out, new = gdn_prompt(ops, q, k, v, g, beta, state)
    assert fake.launches[-1] == "strata_gdn_prompt_f32"
    s, rows = state, []
    for t in range(T):
        o, s = gdn_step(ops, q[t], k[t], v[t], g[t], beta[t], s)
        rows.append(o)
    np.testing.assert_allclose(out, np.stack(rows), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(new, s, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("T,Hv,Hg,Dk,Dv", [(1, 1, 1, 4, 4), (63, 4, 2, 16, 8), (65, 6, 3, 33, 40),
                                           (130, 2, 1, 128, 128), (200, 3, 3, 24, 16)])
def test_chunked_prompt_emulation_matches_the_recurrence(ops, fake, rng, T, Hv, Hg, Dk, Dv):
    """The fake's emulation of cuda/gated_delta_chunk.cu (its scratch layout and its V' = M (V - e^c K S)
    form) is the recurrence up to f32 rounding: 3e-5 of max |out| (the numpy chunked form's bound, with
    the normalization folded into row scales); small decays carry the state across chunks."""
    q, k = rng.standard_normal((2, T, Hg, Dk)).astype(np.float32)
    v = rng.standard_normal((T, Hv, Dv)).astype(np.float32)
    g, beta = -rng.uniform(0.001, 0.06, (T, Hv)).astype(np.float32), rng.uniform(0, 1, (T, Hv)).astype(np.float32)
    state = rng.standard_normal((Hv, Dk, Dv)).astype(np.float32)
    out, new = gdn_prompt_chunked(ops, q, k, v, g, beta, state)
    assert fake.launches[-2:] == ["strata_gdn_chunk_prep_f32", "strata_gdn_chunk_scan_f32"]
    r = Hv // Hg
    qh = np.repeat(l2_normalize(q), r, axis=1) * np.float32(Dk ** -0.5)
    want, want_state = gated_delta_recurrent(qh, np.repeat(l2_normalize(k), r, axis=1), v, g, beta, state)
    np.testing.assert_allclose(out, want, rtol=0, atol=3e-5 * np.abs(want).max())
    np.testing.assert_allclose(new, want_state, rtol=0, atol=3e-5 * np.abs(want_state).max())


def test_bad_shapes_are_refused(ops, rng):
    with pytest.raises(InvalidArgument, match="gdn_conv1d_step"):
        gdn_conv1d_step(ops, np.zeros(4), np.zeros((2, 4)), np.zeros((4, 4)))
    with pytest.raises(InvalidArgument, match="Dk <= 256"):
        gdn_step(ops, np.zeros((1, 257)), np.zeros((1, 257)), np.zeros((1, 4)), np.zeros(1), np.zeros(1),
                 np.zeros((1, 257, 4)))
    with pytest.raises(InvalidArgument, match="Dk <= 128"):
        gdn_prompt_chunked(ops, *np.zeros((2, 64, 1, 129)), np.zeros((64, 1, 4)), np.zeros((64, 1)),
                           np.zeros((64, 1)), np.zeros((1, 129, 4)))


@pytest.mark.parametrize("R,C,K", [(1, 3, 4), (3, 257, 4), (8, 64, 2)])
def test_conv1d_rows_are_each_rows_own_step(ops, fake, rng, R, C, K):
    """strata_gdn_conv1d_rows_f32: row r reads and advances the state at row_states[r] (laid out here in
    reverse row order), as the one-row step over that state alone."""
    from strata.backends.cuda.linear_attn import gdn_conv1d_rows
    x, states = rng.standard_normal((R, C)).astype(np.float32), rng.standard_normal((R, K - 1, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    out, new = gdn_conv1d_rows(ops, x, states, w)
    assert fake.launches[-1] == "strata_gdn_conv1d_rows_f32"
    for r in range(R):
        y, s = gdn_conv1d_step(ops, x[r], states[r], w)
        np.testing.assert_array_equal(out[r], y)
        np.testing.assert_array_equal(new[r], s)


@pytest.mark.parametrize("R,Hv,Hg,Dk,Dv", [(1, 1, 1, 4, 4), (3, 4, 2, 16, 8), (8, 6, 3, 33, 129)])
def test_gdn_step_rows_are_each_rows_own_step(ops, fake, rng, R, Hv, Hg, Dk, Dv):
    from strata.backends.cuda.linear_attn import gdn_step_rows
    q, k = rng.standard_normal((2, R, Hg, Dk)).astype(np.float32)
    v = rng.standard_normal((R, Hv, Dv)).astype(np.float32)
    g, beta = -rng.uniform(0, 2, (R, Hv)).astype(np.float32), rng.uniform(0, 1, (R, Hv)).astype(np.float32)
    states = rng.standard_normal((R, Hv, Dk, Dv)).astype(np.float32)
    out, new = gdn_step_rows(ops, q, k, v, g, beta, states)
    assert fake.launches[-1] == "strata_gdn_step_rows_f32"
    for r in range(R):
        o, s = gdn_step(ops, q[r], k[r], v[r], g[r], beta[r], states[r])
        np.testing.assert_array_equal(out[r], o)
        np.testing.assert_array_equal(new[r], s)
