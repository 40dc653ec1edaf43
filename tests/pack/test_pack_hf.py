"""HF checkpoint -> pack: both on-disk expert layouts, kept dtypes, --qtype quantization, MTP,
tokenizer metadata, config checks, and logits equal to transformers'."""
import json

import numpy as np
import pytest
import torch

from strata.errors import InvalidArgument, UnsupportedError
from strata.pack import convert, open_pack
from tests.fixtures import CHAT_TEMPLATE, SHAPES, make_hf_dir, make_tokenizer


def _expected(model, name):
    """The torch model's tensor behind a pack dense name (numpy float32)."""
    from strata.pack.hf_source import hf_name
    return model.state_dict()[hf_name(name, model.config.num_hidden_layers)].float().numpy()


def test_classic_and_fused_layouts_give_the_same_pack(tmp_path):
    a = convert(make_hf_dir(tmp_path, SHAPES["odd"], seed=1, name="classic")[0], tmp_path / "a", progress=False)
    b = convert(make_hf_dir(tmp_path, SHAPES["odd"], seed=1, fused=True, name="fused")[0], tmp_path / "b",
                progress=False)
    for f in ("dense.bin", "experts.bin", "tokenizer.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes()


@pytest.mark.parametrize("dtype,qname", [(torch.float32, "F32"), (torch.bfloat16, "BF16"), (torch.float16, "F16")])
def test_float_dtypes_kept(tmp_path, dtype, qname):
    hf, model = make_hf_dir(tmp_path, SHAPES["tiny"], seed=2, dtype=dtype)
    pack = open_pack(convert(hf, tmp_path / "pack", progress=False))
    for name in pack.dense_names():
        t = pack.dense(name)
        assert t.qtype == qname
        np.testing.assert_array_equal(t.dequantize(), _expected(model, name))
    sd = model.state_dict()
    I = SHAPES["tiny"]["moe_intermediate_size"]
    for layer in range(pack.args.num_hidden_layers):
        for e in (0, 3):
            parts = pack.expert(layer, e)
            gate_up = sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e].numpy()
            np.testing.assert_array_equal(parts["gate"].dequantize(), gate_up[:I])
            np.testing.assert_array_equal(parts["up"].dequantize(), gate_up[I:])
            np.testing.assert_array_equal(parts["down"].dequantize(),
                                          sd[f"model.layers.{layer}.mlp.experts.down_proj"][e].numpy())


def test_qtype_quantizes_matrices_and_keeps_norms_and_router_f32(tmp_path):
    hf, model = make_hf_dir(tmp_path, SHAPES["odd"], seed=3, dtype=torch.bfloat16)
    pack = open_pack(convert(hf, tmp_path / "pack", qtype="q8_0", progress=False))
    for name in pack.dense_names():
        t = pack.dense(name)
        want = _expected(model, name)
        if name.endswith("norm.weight") or name.endswith("ffn_gate_inp.weight"):
            assert t.qtype == "F32"
            np.testing.assert_array_equal(t.dequantize(), want)
        else:
            assert t.qtype == "Q8_0"
            np.testing.assert_allclose(t.dequantize(), want, atol=np.abs(want).max() / 100)
    assert {p["qtype"] for lay in pack.meta["experts"]["layers"] for p in lay["parts"].values()} == {"Q8_0"}


def test_rows_not_whole_blocks_fall_back_to_f16(tmp_path):
    shape = {**SHAPES["tiny"], "hidden_size": 48, "head_dim": 12}    # rows of 48: not whole Q4_0 blocks
    hf, _ = make_hf_dir(tmp_path, shape, seed=4)
    pack = open_pack(convert(hf, tmp_path / "pack", qtype="Q4_0", progress=False))
    assert pack.dense("blk.0.attn_q.weight").qtype == "F16"
    assert pack.expert(0, 0)["down"].qtype == "Q4_0"     # rows of I = 32
    assert any("blk.0.attn_q.weight" in n for n in pack.meta["notes"])


def test_qtype_errors(tmp_path):
    hf, _ = make_hf_dir(tmp_path, SHAPES["tiny"], seed=5)
    with pytest.raises(InvalidArgument, match="Q4_K"):
        convert(hf, tmp_path / "pack", qtype="Q4_K", progress=False)
    with pytest.raises(UnsupportedError, match="XQ9"):
        convert(hf, tmp_path / "pack", qtype="XQ9", progress=False)


def test_logits_equal_transformers(tmp_path):
    import strata
    hf, model = make_hf_dir(tmp_path, SHAPES["odd"], seed=6)
    llm = strata.LLM(str(convert(hf, tmp_path / "pack", progress=False)), device="cpu")
    ids = list(np.random.default_rng().integers(0, 300, size=11))
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(llm.logits(ids), want, atol=2e-4 * np.abs(want).max())


def test_mtp_layer_from_qwen3_next_names(tmp_path):
    from safetensors.numpy import load_file
    hf, _ = make_hf_dir(tmp_path, SHAPES["mtp"], seed=7)
    pack = open_pack(convert(hf, tmp_path / "pack", progress=False))
    L = SHAPES["mtp"]["num_hidden_layers"]
    assert pack.args.num_mtp_layers == 1 and len(pack.meta["experts"]["layers"]) == L + 1
    mtp = load_file(str(hf / "model-mtp.safetensors"))
    np.testing.assert_array_equal(pack.dense(f"blk.{L}.nextn.eh_proj.weight").dequantize(), mtp["mtp.fc.weight"])
    np.testing.assert_array_equal(pack.dense(f"blk.{L}.nextn.enorm.weight").dequantize(),
                                  mtp["mtp.pre_fc_norm_embedding.weight"])
    np.testing.assert_array_equal(pack.dense(f"blk.{L}.attn_k.weight").dequantize(),
                                  mtp["mtp.layers.0.self_attn.k_proj.weight"])
    np.testing.assert_array_equal(pack.dense(f"blk.{L}.nextn.shared_head_norm.weight").dequantize(),
                                  mtp["mtp.norm.weight"])
    np.testing.assert_array_equal(pack.expert(L, 2)["up"].dequantize(),
                                  mtp["mtp.layers.0.mlp.experts.2.up_proj.weight"])


def test_tokenizer_copied_with_metadata(tmp_path):
    hf, _ = make_hf_dir(tmp_path, SHAPES["tiny"], seed=8)
    pack = open_pack(convert(hf, tmp_path / "pack", progress=False))
    assert pack.tokenizer_path.read_bytes() == (hf / "tokenizer.json").read_bytes()
    tok = make_tokenizer(300)
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    meta = pack.tokenizer_meta
    assert meta["eos_token_ids"] == [im_end, eot]       # tokenizer_config, then generation_config
    assert (meta["bos_token_id"], meta["pad_token_id"], meta["add_bos_token"]) == (None, eot, False)
    assert meta["chat_template"] == CHAT_TEMPLATE


@pytest.mark.parametrize("edit,match", [
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "LlamaForCausalLM"),
    ({"num_nextn_predict_layers": 2}, "2 MTP layers"),
])
def test_unsupported_configs(tmp_path, edit, match):
    hf, _ = make_hf_dir(tmp_path, SHAPES["tiny"], seed=9)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(UnsupportedError, match=match):
        convert(hf, tmp_path / "pack", progress=False)
    assert not (tmp_path / "pack").exists()


def test_quantization_in_row_slabs_equals_whole_tensor():
    from strata.pack.hf_source import _quantize_rows
    from strata.quant.quantize import quantize
    x = np.random.default_rng().standard_normal((37, 64)).astype(np.float32)
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)
    whole = quantize("Q4_1", (bf16.astype(np.uint32) << 16).view(np.float32))
    slabs = _quantize_rows("Q4_1", "BF16", bf16.reshape(-1).view(np.uint8), (37, 64), chunk_f32_bytes=4 * 64 * 5)
    assert slabs.tobytes() == whole.tobytes()


def test_yarn_rope_parameters(tmp_path):
    """transformers 5 writes rope_parameters (theta and scaling together); both reach ModelArgs."""
    import strata
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    shape = {k: v for k, v in SHAPES["tiny"].items() if k != "rope_theta"}
    hf, model = make_hf_dir(tmp_path, {**shape, "rope_parameters": {**yarn, "rope_theta": 5e5}}, seed=10)
    pack = open_pack(convert(hf, tmp_path / "pack", progress=False))
    assert (pack.args.rope_theta, pack.args.rope_scaling) == (5e5, yarn)
    ids = list(range(3, 60, 3))
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    got = strata.LLM(str(pack.path), device="cpu").logits(ids)
    np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max())
