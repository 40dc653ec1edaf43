"""The synthetic qwen3-next-80b-a3b shape and what `strata plan` prices for it (on the CPU)."""
import numpy as np
import pytest

from strata.config import EngineConfig
from strata.engine.planner import kv_bytes, make_plan
from strata.plan import plan_sizes
from strata.synthetic import synthetic_source

GIB = 2**30


@pytest.fixture(scope="module")
def next80():
    return plan_sizes(None, "qwen3-next-80b-a3b")[1]


def test_shape_is_the_real_config_with_a_q4_k_m_style_mix(next80):
    a = next80.args
    assert (a.architecture, a.num_hidden_layers, a.num_experts, a.num_experts_per_tok) == ("qwen3next", 48, 512, 10)
    assert sum(a.is_full_attention(l) for l in range(48)) == 12 and a.shared_expert_intermediate_size == 512
    d = next80.dense
    assert d["blk.0.attn_qkv.weight"]["shape"] == [2 * 16 * 128 + 32 * 128, 2048]
    assert d["blk.3.attn_q.weight"]["shape"] == [2 * 16 * 256, 2048]         # queries and their gates
    assert {d[n]["qtype"] for n in ("blk.0.ssm_conv1d.weight", "blk.0.ssm_a", "blk.0.ffn_gate_inp.weight",
                                    "blk.0.ffn_gate_inp_shexp.weight", "blk.3.attn_q_norm.weight")} == {"F32"}
    assert d["blk.0.ffn_up_shexp.weight"]["qtype"] == "Q6_K" and d["blk.0.attn_gate.weight"]["qtype"] == "Q8_0"
    assert next80.layers[0]["parts"]["gate"]["qtype"] == "Q4_K"
    # 48 layers x 512 experts x 3 Q4_K matrices of 512 x 2048, plus the MTP layer's
    assert sum(l["blob_bytes"] for l in next80.layers) * 512 == 49 * 512 * 3 * 512 * 2048 * 144 // 256


def test_synthetic_vectors_are_sane():
    src = synthetic_source("qwen3-next-80b-a3b")
    by_name = {t.name: t for t in src.dense}
    ssm_a = by_name["blk.0.ssm_a"].read().view(np.float32)
    norm = by_name["blk.0.post_attention_norm.weight"].read().view(np.float32)
    assert ssm_a.shape == (32,) and (ssm_a < 0).all()          # -exp(A_log): a decay
    assert abs(norm.mean() - 1) < 0.05
    conv = by_name["blk.0.ssm_conv1d.weight"]
    assert conv.read().nbytes == 4 * 8192 * 4


def test_kv_counts_attention_layers_and_the_fixed_states(next80):
    a = next80.args
    cells = 4096
    row = a.num_key_value_heads * a.head_dim
    states = 36 * 4 * (3 * 8192 + 32 * 128 * 128)
    assert kv_bytes(a, cells, "f16", 49) == 2 * 13 * cells * row * 2 + states      # 12 + the MTP layer
    assert kv_bytes(a, 2 * cells, "f16", 49) - kv_bytes(a, cells, "f16", 49) == 2 * 13 * cells * row * 2


@pytest.mark.parametrize("budget_gib", [139, 12, 8])
def test_plan_at_budgets(next80, budget_gib):
    plan = make_plan(next80, EngineConfig(device="cpu"), budget_gib * GIB, "test")
    assert plan.mandatory_bytes + plan.cache_bytes <= budget_gib * GIB
    assert plan.total_experts == 48 * 512
    if budget_gib == 139:
        assert plan.cache_slots == plan.total_experts and plan.prefill_ring == 0
    else:
        assert 0 < plan.cache_slots < plan.total_experts and plan.prefill_ring > 0 and plan.prefill_chunk >= 256

