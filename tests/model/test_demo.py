"""The built-in demo model (strata/demo): its checksums, the numpy engine against the torch model it was
trained as (main and MTP heads, same weights), the greedy continuation recorded when it was packed,
and the torch model's main head against transformers' Qwen3MoeForCausalLM."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import strata
from strata.backends.cpu import CpuOps, KVCache
from strata.engine.llm import DEMO_PACK
from strata.errors import PackError
from strata.model.qwen3moe import Qwen3Moe
from strata.pack import open_pack
from tests.fixtures import load_tool

METRICS = json.loads((DEMO_PACK / "metrics.json").read_text())
REFERENCE = METRICS["pack"]["reference"]


def demo_model_module():
    """tools/demo_model.py (the torch model), loaded by path: tools/ is not a package."""
    pytest.importorskip("torch")
    return load_tool("demo_model")


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def llm():
    return strata.LLM(device="cpu")


def test_demo_pack_verifies_and_is_small():
    with open_pack(DEMO_PACK, verify=True) as pack:
        a = pack.args
        assert (a.architecture, a.num_mtp_layers, a.num_experts, a.vocab_size) == ("qwen3moe", 1, 16, 8192)
        assert sum(f["bytes"] for f in pack.meta["files"].values()) <= 40 << 20


def test_demo_pack_checksum_catches_a_flipped_byte(tmp_path):
    dst = tmp_path / "demo"
    shutil.copytree(DEMO_PACK, dst, ignore=shutil.ignore_patterns(".verified.json"))
    rng = np.random.default_rng()
    target = dst / "experts.bin"
    data = bytearray(target.read_bytes())
    i = int(rng.integers(0, len(data)))
    data[i] ^= 0x5A
    target.write_bytes(bytes(data))
    with pytest.raises(PackError, match="experts.bin"):
        open_pack(dst, verify=True)


def test_engine_matches_the_torch_model_on_both_heads():
    torch = pytest.importorskip("torch")
    tmodel = demo_model_module().model_from_pack(DEMO_PACK)
    with open_pack(DEMO_PACK) as pack:
        a = pack.args
        T = 37
        ids = np.random.default_rng().integers(0, a.vocab_size, T)
        with torch.no_grad():
            t_logits, t_hidden, _ = tmodel.forward_main(torch.from_numpy(ids)[None])
            t_mtp, _ = tmodel.forward_mtp(t_hidden[:, :-1], torch.from_numpy(ids[1:])[None])
        model = Qwen3Moe(a, CpuOps(pack, a))
        kv = KVCache(a.num_hidden_layers + a.num_mtp_layers, a.num_key_value_heads, a.head_dim, 64)
        logits, hidden = model.forward(ids, np.arange(T), kv)
        mtp = model.mtp_forward(hidden[:-1], ids[1:], np.arange(T - 1), kv)
    assert rel_err(logits, t_logits[0].numpy()) < 1e-4
    assert rel_err(hidden, t_hidden[0].numpy()) < 1e-4
    assert rel_err(mtp, t_mtp[0].numpy()) < 1e-4


def test_greedy_continuation_is_the_recorded_one(llm):
    assert llm.tokenizer.encode(REFERENCE["prompt"]) == REFERENCE["prompt_ids"]
    out = llm.generate(REFERENCE["prompt"], max_tokens=len(REFERENCE["greedy_ids"]))
    assert out.token_ids == REFERENCE["greedy_ids"]
    assert out.text == REFERENCE["greedy_text"]


def test_mtp_drafts_agree_with_greedy(llm):
    """Along the recorded greedy path the draft layer's guess for t+2 is mostly the token greedy chose."""
    seq = np.asarray(REFERENCE["prompt_ids"] + REFERENCE["greedy_ids"])
    a = llm.args
    model = Qwen3Moe(a, llm.runner.ops)
    kv = KVCache(a.num_hidden_layers + a.num_mtp_layers, a.num_key_value_heads, a.head_dim, len(seq))
    _, hidden = model.forward(seq[:-1], np.arange(len(seq) - 1), kv)
    drafts = model.mtp_forward(hidden[:-1], seq[1:-1], np.arange(len(seq) - 2), kv).argmax(-1)
    start = len(REFERENCE["prompt_ids"]) - 1
    accepted = np.mean(drafts[start:] == seq[start + 2:])
    assert accepted >= 0.5


def test_chat_template_is_chatml(llm):
    tok = llm.tokenizer
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "What does `os.getcwd` do?"}])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat does `os.getcwd` do?"
                    "<|im_end|>\n<|im_start|>assistant\n")
    assert len(tok.encode(text)) < len(text) // 2        # the markers are single special tokens
    assert set(tok.eos_token_ids) == {tok.encode("<|im_end|>")[0], tok.encode("<|endoftext|>")[0]}


def test_torch_model_main_head_matches_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    dm = demo_model_module()
    cfg = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
               rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=256, num_nextn_predict_layers=1)
    seed = int(np.random.default_rng().integers(1 << 30))
    model = dm.DemoModel(cfg)
    model.init_weights(seed, std=0.1)
    with torch.no_grad():                       # norms away from one, so their weights are checked too
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    dm.save_hf(model, tmp_path, dtype=torch.float32)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, cfg["vocab_size"], (2, 29)))
    with torch.no_grad():
        ours = model.eval().forward_main(ids)[0]
        theirs = hf(ids).logits
    assert rel_err(ours.numpy(), theirs.numpy()) < 1e-5
