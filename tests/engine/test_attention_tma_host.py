"""The host side of attention_ws.cu's TMA build on tests/engine/fake_cuda (no GPU): the numpy wrapper
and the engine pass K's and V's tensor maps over the cells up to the chunk's last position, so the
cache's cells past it (NaN here, as fresh memory may hold) are never read, and the rows equal the
cp.async build's contract."""
import numpy as np

from strata.backends.cuda.attention_tc import attention_prefill_tc
from strata.backends.cuda.kernels import attention_tensor_maps
from strata.backends.cpu import causal_attention


def _case(rng, T=37, offset=50, H=8, Hk=2, dh=128, pad=9):
    S = offset + T
    q = rng.standard_normal((T, H, dh)).astype(np.float32)
    k = rng.standard_normal((S + pad, Hk, dh)).astype(np.float16)
    v = rng.standard_normal((S + pad, Hk, dh)).astype(np.float16)
    k[S:], v[S:] = np.nan, np.nan
    return q, k, v, np.arange(offset, S, dtype=np.int32)


def test_the_wrapper_passes_maps_over_the_chunks_cells(fake):
    q, k, v, pos = _case(np.random.default_rng(3))
    out = attention_prefill_tc(q, k, v, pos, wgmma=True, tma=True)
    S = int(pos.max()) + 1
    ref = causal_attention(q, k[:S].astype(np.float32), v[:S].astype(np.float32), pos)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref.reshape(out.shape), rtol=1e-5, atol=1e-5)
    assert fake.launches[-1] == "strata_attention_prefill_wst128_f16_d128"


def test_maps_name_each_cache_and_the_cells(fake):
    k_map, v_map = attention_tensor_maps(fake, 4096, 8192, 4, 128, 300)
    assert fake._TENSOR_MAP.unpack(k_map[:72]) == (4096, 128, 4, 300, 256, 1024, 64, 1, 128)
    assert fake._TENSOR_MAP.unpack(v_map[:72])[0] == 8192 and len(k_map) == len(v_map) == 128
