"""cuda/gated_delta_chunk.cu (the chunked WY / UT form of the gated delta rule) against a float64
recurrence and against the token loop (cuda/gated_delta.cu strata_gdn_prompt_f32).

Bound, derived as tests/kernels/test_gated_delta_gpu.py's step bound: an output is Qn S (Dk products)
plus P V' (C = 64 products), V' = M R (C products), R = V - Kn e^c S (Dk products): a chain of at most
Dk + 2C accumulated terms, each within a few ulp (expf, sqrtf, the products' roundings; the scan's
3xTF32 products are within 3 * 2^-22 ~ 12 u of exact): 1e-6 (~17 u) per term of the largest
magnitude, atol 1e-6 * (Dk + 2C + 8) * max(1, max|S|), |S| the state's (the outputs are q . S with
|q| <= 1/sqrt(Dk)); the new state is e^c S plus Kn^T V' (C products). Errors carried over chunks do
not grow: the delta rule contracts the state (|I - beta k k^T| <= 1, decays <= 1), and they add as
random roundings, sqrt(T / C) times one chunk's typical sqrt(Dk + 2C) u, far inside the linear bound
at T = 2048. Against the token kernel (its own bound, Dk + 8 terms): the sum of both. The decays are
small (-g in [0.001, 0.06]) so the state crosses chunks with most of its weight.
"""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

C = 64


@pytest.fixture(scope="module")
def ops():
    from strata.backends.cuda.testing import CudaOps
    return CudaOps()


def recurrent_f64(q, k, v, g, beta, S):
    """The rule token by token in float64: q, k [T, Hg, Dk] raw, the rest as gdn_prompt."""
    T, Hg, Dk = q.shape
    r = v.shape[1] // Hg
    q, k = (np.repeat(a.astype(np.float64) / np.sqrt((a.astype(np.float64) ** 2).sum(-1, keepdims=True) + 1e-6),
                      r, axis=1) for a in (q, k))
    q = q / np.sqrt(Dk)
    S = S.astype(np.float64)
    out = np.empty(v.shape, np.float64)
    for t in range(T):
        S = S * np.exp(g[t].astype(np.float64))[:, None, None]
        d = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", S, k[t]))
        S = S + k[t][:, :, None] * d[:, None, :]
        out[t] = np.einsum("hkv,hk->hv", S, q[t])
    return out, S


def draw(rng, T, Hv, Hg, Dk, Dv, with_state):
    q, k = rng.standard_normal((2, T, Hg, Dk)).astype(np.float32)
    v = rng.standard_normal((T, Hv, Dv)).astype(np.float32)
    g = -rng.uniform(0.001, 0.06, (T, Hv)).astype(np.float32)
    beta = rng.uniform(0.05, 1, (T, Hv)).astype(np.float32)
    S = rng.standard_normal((Hv, Dk, Dv)).astype(np.float32) if with_state else np.zeros((Hv, Dk, Dv), np.float32)
    return q, k, v, g, beta, S


def bound(Dk, S):
    return 1e-6 * (Dk + 2 * C + 8) * max(1.0, float(np.abs(S).max()))


def assert_is_the_recurrence(out, S, q, k, v, g, beta, S0):
    """out and the state S after the prompt within bound() of the float64 recurrence from S0; -> (the
    recurrence's out, the tolerance used)."""
    want, want_S = recurrent_f64(q, k, v, g, beta, S0)
    tol = bound(q.shape[-1], want_S) + bound(q.shape[-1], S0)
    np.testing.assert_allclose(out, want, rtol=0, atol=tol)
    np.testing.assert_allclose(S, want_S, rtol=0, atol=tol)
    return want, tol


# T: one token, a chunk less one, one chunk, one more, a short last chunk, 32 chunks;
# shapes: Qwen3-Next-80B's (32, 16, 128, 128) and odd ones (Dk not a multiple of 32, Dv past one tile)
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "state"])
@pytest.mark.parametrize("T,Hv,Hg,Dk,Dv", [(1, 32, 16, 128, 128), (63, 32, 16, 128, 128), (64, 32, 16, 128, 128),
                                           (65, 32, 16, 128, 128), (300, 32, 16, 128, 128),
                                           (2048, 32, 16, 128, 128), (300, 6, 3, 33, 40), (130, 4, 2, 16, 8),
                                           (97, 3, 1, 100, 70)])
def test_chunked_equals_the_recurrence_and_the_token_kernel(ops, rng, T, Hv, Hg, Dk, Dv, with_state):
    from strata.backends.cuda.linear_attn import gdn_prompt, gdn_prompt_chunked
    q, k, v, g, beta, S0 = draw(rng, T, Hv, Hg, Dk, Dv, with_state)
    out, S = gdn_prompt_chunked(ops, q, k, v, g, beta, S0)
    want, tol = assert_is_the_recurrence(out, S, q, k, v, g, beta, S0)
    tok, tok_S = gdn_prompt(ops, q, k, v, g, beta, S0)
    np.testing.assert_allclose(out, tok, rtol=0, atol=2 * tol)
    np.testing.assert_allclose(S, tok_S, rtol=0, atol=2 * tol)
    assert np.abs(want).max() > 10 * tol         # the bound is not vacuous: the outputs are not decayed away


def test_chunked_prompt_resumes_from_its_own_state(ops, rng):
    """Two launches over 100 + 200 tokens, the state carried in between, equal one over 300."""
    from strata.backends.cuda.linear_attn import gdn_prompt_chunked
    q, k, v, g, beta, S0 = draw(rng, 300, 8, 4, 128, 128, True)
    out, S = gdn_prompt_chunked(ops, q, k, v, g, beta, S0)
    a, Sa = gdn_prompt_chunked(ops, q[:100], k[:100], v[:100], g[:100], beta[:100], S0)
    b, Sb = gdn_prompt_chunked(ops, q[100:], k[100:], v[100:], g[100:], beta[100:], Sa)
    tol = 2 * bound(128, S)
    np.testing.assert_allclose(np.concatenate([a, b]), out, rtol=0, atol=tol)
    np.testing.assert_allclose(Sb, S, rtol=0, atol=tol)
