"""The GPU engine's host logic, on the CPU: CudaRunner over tests/engine/fake_cuda, whose kernels are
numpy emulations of their contracts. Addresses, strides, grouping and launch arguments are checked
here; the kernels themselves in tests/kernels and the whole path in test_cuda_runner.py, on a GPU."""
import numpy as np
import pytest

import strata.backends.cuda as cuda_backend
from strata.backends.cuda_device import Pool, gemv_grid
from strata.backends.cuda_moe import group_by_expert
from strata.engine import llm as llm_module
from strata.engine.cuda_runner import CudaRunner, prefill_chunk_of
from strata.engine.llm import demo_model_path
from strata.errors import DeviceError, InvalidArgument
from strata.pack import open_pack
from tests.engine import fake_cuda
from tests.engine.cpu_f16_kv import cpu_runner_f16_kv

DEMO = demo_model_path()


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(cuda_backend, "_runtime", lambda: fake_cuda)
    fake_cuda.launches.clear()
    return fake_cuda


def assert_close(ours, ref, rel=3e-4):
    """Against the numpy engine with the same f16 K/V (the bound of test_cuda_runner.py)."""
    bound = rel * np.abs(ref).max()
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= bound, f"max err {np.abs(ours - ref).max():.3g} > {bound:.3g}"


def test_emulated_runner_matches_cpu_on_the_demo_model(fake, rng):
    pack = open_pack(DEMO)
    gpu, cpu = CudaRunner(pack, 64), cpu_runner_f16_kv(pack, 64)
    gpu.prefill_chunk = cpu.prefill_chunk = 12          # a grouped-MoE chunk of 12, then a GEMV chunk of 8
    ids = rng.integers(0, pack.args.vocab_size, 20).tolist()
    assert_close(gpu.logits_all(ids), cpu.logits_all(ids))
    assert_close(gpu.prefill(ids[:15], 0), cpu.prefill(ids[:15], 0))
    for t in ids[15:18]:
        assert_close(gpu.decode(t), cpu.decode(t))
    used = set(fake.launches)
    assert {"strata_moe_gemv_q8_0", "strata_gemm_f32_nt", "strata_gemv_batch_q8_0",
            "strata_attention_decode_f16_d64_g2", "strata_attention_prefill_f16_d64"} <= used


def test_emulated_runner_other_head_dims_and_f32_weights(fake, tmp_path, rng):
    pytest.importorskip("torch")
    from tests.fixtures import SHAPES, make_pack
    path, _ = make_pack(tmp_path, SHAPES["odd"], seed=2)        # Dh 24: the generic attention kernel
    pack = open_pack(path)
    gpu, cpu = CudaRunner(pack, 32), cpu_runner_f16_kv(pack, 32)
    ids = rng.integers(0, pack.args.vocab_size, 11).tolist()
    assert_close(gpu.logits_all(ids), cpu.logits_all(ids))
    assert_close(gpu.prefill(ids[:9], 0), cpu.prefill(ids[:9], 0))
    assert_close(gpu.decode(ids[9]), cpu.decode(ids[9]))
    assert "strata_attention_rows_f16" in fake.launches and "strata_moe_gemv_f32" in fake.launches


def test_emulated_runner_k_quants_mixed_per_layer(fake, tmp_path, rng):
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    from tests.fixtures import SHAPES, make_gguf_pack
    qtypes = {"attn": ["Q4_K", "Q8_0"], "experts": ["Q6_K", "Q4_K"], "embd": "Q6_K", "output": "Q8_0"}
    path, _ = make_gguf_pack(tmp_path, SHAPES["kquant"], qtypes, seed=4)
    pack = open_pack(path)
    gpu, cpu = CudaRunner(pack, 32), cpu_runner_f16_kv(pack, 32)
    ids = rng.integers(0, pack.args.vocab_size, 10).tolist()
    assert_close(gpu.logits_all(ids), cpu.logits_all(ids))
    assert_close(gpu.prefill(ids, 0), cpu.prefill(ids, 0))
    assert_close(gpu.decode(ids[0]), cpu.decode(ids[0]))
    assert {"strata_moe_gemv_q6_k", "strata_moe_gemv_q4_k", "strata_dequant_q4_k"} <= set(fake.launches)


def test_status_and_limits(fake):
    runner = CudaRunner(open_pack(DEMO), 64)
    runner.prefill([1, 2, 3], 0)
    s = runner.status()
    assert s["device"] == "cuda" and s["prefill_ring"] == 0 and s["prefill_chunk"] == 512
    assert set(s["gpu"]) == {"name", "vram_budget_bytes", "vram_used_bytes", "dense_bytes", "expert_cache_bytes",
                             "kv_bytes", "prompt_bytes"}
    cache = s["expert_cache"]
    assert cache["resident"] == cache["total_experts"] == 7 * 16 and cache["hits"] == 3 * 4 * 6
    assert s["bytes_h2d"] >= s["gpu"]["dense_bytes"] + s["gpu"]["expert_cache_bytes"]
    assert runner.measure_limits(nbytes=1 << 24, repeats=2)["device_copy_gb_s"] > 0


def test_too_big_for_the_budget_says_so(fake):
    from strata.config import EngineConfig
    with pytest.raises(DeviceError, match="budget"):
        CudaRunner(open_pack(DEMO), 64, EngineConfig(device="cuda", vram_budget_gib=0.01))


def test_group_by_expert(rng):
    ids = rng.integers(0, 9, (23, 4)).astype(np.int32)
    order, experts, starts, counts, rows = group_by_expert(ids)
    flat = ids.reshape(-1)
    assert (np.diff(flat[order]) >= 0).all() and counts.sum() == flat.size
    for e, s0, c in zip(experts, starts, counts):
        assert (flat[order[s0:s0 + c]] == e).all()
    assert (order[rows] == np.arange(flat.size)).all()          # rows[s] is where slot s went


def test_pool_reuses_and_coalesces(fake):
    pool = Pool(fake, fake.Device(0))
    a, _ = pool.alloc(1000)
    b, _ = pool.alloc(5000)
    assert (a.offset, b.offset, pool.used_bytes) == (0, 1024, 1024 + 5120)
    del a, b
    assert pool.used_bytes == 0 and pool.free == [[[0, pool.capacity_bytes]]]
    c, _ = pool.alloc(6000)
    assert c.offset == 0 and len(pool.segments) == 1
    big, _ = pool.alloc(pool.capacity_bytes)       # does not fit beside c: a second segment
    assert len(pool.segments) == 2 and big.seg == 1


@pytest.mark.parametrize("qtype, n", [("Q8_0", 64), ("Q4_K", 256), ("Q6_K", 2048), ("F32", 24), ("F16", 96)])
def test_gemv_grid_covers_every_row(qtype, n):
    for rows in (1, 7, 64, 1000, 151936):
        units = {"Q8_0": n // 32, "Q4_K": n // 64, "Q6_K": n // 64}.get(qtype, n // 8 if n % 8 == 0 else n)
        lanes = min(32, 1 << (max(units, 1) - 1).bit_length())
        krows = 2 if qtype in ("Q6_K", "F32", "F16") else 4
        assert gemv_grid(qtype, rows, n) * 4 * (32 // lanes) * krows >= rows


def test_prefill_chunk_setting():
    assert prefill_chunk_of("auto") == 512 and prefill_chunk_of("96") == 96 and prefill_chunk_of("auto:128") == 128
    with pytest.raises(InvalidArgument):
        prefill_chunk_of("0")


def test_device_choice(monkeypatch):
    monkeypatch.setattr(cuda_backend, "unavailable_reason", lambda device=0: "no GPU here")
    assert llm_module._pick_device("auto") == "cpu" and llm_module._pick_device("cpu") == "cpu"
    with pytest.raises(DeviceError, match="no GPU here"):
        llm_module._pick_device("cuda")
    monkeypatch.setattr(cuda_backend, "unavailable_reason", lambda device=0: None)
    assert llm_module._pick_device("auto") == "cuda" == llm_module._pick_device("cuda")
