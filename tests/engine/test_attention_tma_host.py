"""The host side of attention_ws.cu's TMA build on tests/engine/fake_cuda (no GPU): the numpy wrapper
and the engine pass K's and V's tensor maps over the cells up to the chunk's last position, so the
cache's cells past it (NaN here, as fresh memory may hold) are never read, and the rows equal the
cp.async build's contract."""
import numpy as np

from strata.backends.cuda.attention_tc import attention_prefill_tc
from strata.backends.cuda.kernels import attention_tensor_maps
from strata.backends.cpu import causal_attention
from tests.fixtures import load_tool


def _case(rng):
    """A chunk of 37 queries after 50 cells, 8 heads over 2, Dh 128, NaN cells past the last position
    (tools/attention_wg_ab.py's cases)."""
    return load_tool("attention_wg_ab").make_case(rng, 128, 8, 2, 37, 50, pad=9)


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


def test_the_engine_takes_the_tma_build_by_default_at_head_dim_128(fake, tmp_path, monkeypatch):
    """tma-attention (on by default where attention_ws.cu's sm_90a library is, as fake_cuda's sm_90 build
    has it): prompt chunks at head dim 128 launch the TMA build with maps of their own cells, a second
    chunk's over the first's cells too; --kernels-off tma-attention gives attention_tc.cu's kernel and
    the same logits here (one contract); an install without the library falls back to it."""
    import pytest
    pytest.importorskip("torch")
    from strata.config import EngineConfig
    from strata.engine.cuda_runner import CudaRunner
    from strata.pack import open_pack
    from tests.fixtures import SHAPES, make_pack

    import strata.engine.planner as planner
    path, _ = make_pack(tmp_path, dict(SHAPES["tiny"], head_dim=128), seed=4)
    ids = np.random.default_rng(5).integers(0, 300, 40)
    priced, make_plan = [], planner.make_plan          # the load's plan prices the path it will take
    monkeypatch.setattr(planner, "make_plan", lambda *a, **k: priced.append(k.get("tma_attention")) or make_plan(*a, **k))

    def run(config=EngineConfig()):
        fake.launches.clear()
        runner = CudaRunner(open_pack(path), 64, config)
        return [runner.prefill(ids[:24], 0), runner.prefill(ids, 24)], list(fake.launches)
    tma, launched = run()
    assert launched.count("strata_attention_prefill_wst128_f16_d128") == 4      # 2 layers x 2 chunks
    assert not [n for n in launched if n.startswith("strata_attention_prefill_tc_")]
    assert priced == [True]
    tc, launched = run(EngineConfig(kernels_off="tma-attention"))
    assert priced == [True, False]
    assert "strata_attention_prefill_tc_f16_d128" in launched and "strata_attention_prefill_wst128_f16_d128" not in launched
    for a, b in zip(tma, tc):
        np.testing.assert_array_equal(a, b)
    kept = {lib: e for lib, e in fake.read_manifest()["kernels"].items() if lib != "attention_ws"}
    monkeypatch.setattr(fake, "read_manifest", lambda directory=None: {"format": 1, "kernels": kept})
    _, launched = run()
    assert "strata_attention_prefill_tc_f16_d128" in launched


def test_head_dim_256_takes_the_tma_build(fake, tmp_path, monkeypatch):
    """Qwen3-Next's attention layers at Dh 256: the TMA build on 64-cell tiles by default (tma-attention),
    attention_tc.cu's kernel with --kernels-off tma-attention, the same logits here (one contract);
    --kernels-on wgmma-attention, which has no Dh-256 kernel of its own now, is refused in one line."""
    import pytest
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from strata.config import EngineConfig
    from strata.engine.cuda_runner import CudaRunner
    from strata.errors import UnsupportedError
    from strata.pack import open_pack
    from tests.fixtures_qwen3next import NEXT_SHAPES, make_next_pack

    path, _ = make_next_pack(tmp_path, dict(NEXT_SHAPES["tiny"], head_dim=256), seed=6)
    ids = np.random.default_rng(7).integers(0, 300, 30)

    def run(config=EngineConfig()):
        fake.launches.clear()
        out = CudaRunner(open_pack(path), 64, config).prefill(ids, 0)
        return out, list(fake.launches)
    base, launched = run(EngineConfig(kernels_off="tma-attention"))
    assert "strata_attention_prefill_tc_f16_d256" in launched
    assert "strata_attention_prefill_wst64_f16_d256" not in launched
    tma, launched = run()
    assert launched.count("strata_attention_prefill_wst64_f16_d256") == 2     # its two attention layers
    assert not [n for n in launched if n.startswith("strata_attention_prefill_tc_")]
    np.testing.assert_array_equal(tma, base)
    with pytest.raises(UnsupportedError, match=r"wgmma-attention \(--kernels-on\): this model's head dim is 256"):
        run(EngineConfig(kernels_on="wgmma-attention"))
