"""Tiny Qwen3-Next (qwen3next) models for tests: HF checkpoints, llama.cpp-style GGUFs, packs.

The GGUF side writes tensors the way llama.cpp's convert_hf_to_gguf.py writes qwen3next (names and
value rules listed in strata/pack/qwen3next_names.py), but with code of its own here, so a wrong rule
in the converter cannot agree with itself: random valid block bytes per tensor, and the oracle
Qwen3NextForCausalLM built back from their gguf.quants dequantization by the inverse rules.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np

from tests.fixtures import _gguf_metadata, _tokenizer_files, dequantize_bytes, make_tokenizer, random_tensor_bytes

_COMMON = dict(rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False, decoder_sparse_step=1,
               mlp_only_layers=[], attention_bias=False, hidden_act="silu", initializer_range=0.05,
               linear_conv_kernel_dim=4)

NEXT_SHAPES: dict[str, dict] = {
    # 4 layers, attention every 2nd; GQA in the DeltaNet (4 value heads over 2 key heads); rope on 1/4.
    "tiny": dict(_COMMON, vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                 full_attention_interval=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48, norm_topk_prob=True),
    # 3 layers, attention every 3rd; equal key and value heads; rope on 1/2; no top-k renormalization.
    "odd": dict(_COMMON, vocab_size=300, hidden_size=96, intermediate_size=64, num_hidden_layers=3,
                full_attention_interval=3, num_attention_heads=3, num_key_value_heads=1, head_dim=24,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
                linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=24,
                linear_value_head_dim=16, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=40,
                shared_expert_intermediate_size=24, norm_topk_prob=False),
    # 4 layers, attention every 4th (Qwen3-Next's own interval); 3 value heads per key head; full rope.
    "wide": dict(_COMMON, vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                 full_attention_interval=4, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0},
                 linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=32,
                 linear_value_head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
                 shared_expert_intermediate_size=32, norm_topk_prob=True),
    # Rows of 256 where K-quants go (D, I, Is), Q8_0 rows (128) elsewhere.
    "kquant": dict(_COMMON, vocab_size=300, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                   full_attention_interval=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                   linear_value_head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                   shared_expert_intermediate_size=256, norm_topk_prob=True),
}


def hf_config(shape: Mapping):
    from transformers import Qwen3NextConfig
    return Qwen3NextConfig(**dict(shape))


def _init_weights(model, seed: int) -> None:
    """Weights large enough that logits are not flat, routing is not uniform and the decay varies."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight"):               # zero-centred: the model adds 1
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 8.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def _with_ids(shape: Mapping, tok):
    cfg = hf_config(shape)
    cfg.eos_token_id = tok.token_to_id("<|im_end|>")
    cfg.bos_token_id = tok.token_to_id("<|endoftext|>")
    return cfg


def make_next_hf_dir(tmp_path, shape: Mapping, seed: int = 0, name: str = "hf", dtype=None):
    """A random Qwen3NextForCausalLM saved by save_pretrained under tmp_path/name (with tokenizer
    files), stored in dtype (a torch dtype, default float32); returns (path, float32 eval model
    holding exactly the stored, rounded, weights)."""
    import torch
    from transformers import Qwen3NextForCausalLM
    path = Path(tmp_path) / name
    tok = make_tokenizer(shape["vocab_size"])
    model = Qwen3NextForCausalLM(_with_ids(shape, tok))
    _init_weights(model, seed)
    model.generation_config.eos_token_id = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    inv_freq = model.model.rotary_emb.inv_freq.clone()      # a buffer .to(dtype) would round too
    model.to(dtype or torch.float32).save_pretrained(path)
    _tokenizer_files(path, tok)
    model = model.float().eval()
    model.model.rotary_emb.inv_freq.copy_(inv_freq)
    return path, model


def add_mtp_layer(hf: Path, shape: Mapping, seed: int = 0) -> dict:
    """Random HF mtp.* tensors (one draft layer; transformers itself ignores them) written beside the
    checkpoint in hf, and num_nextn_predict_layers = 1 in its config -> the tensors, float64."""
    import json

    from safetensors.numpy import save_file
    cfg = json.loads((hf / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (hf / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(seed)
    D, Dh, E, I = shape["hidden_size"], shape["head_dim"], shape["num_experts"], shape["moe_intermediate_size"]
    H, Hk, Is = shape["num_attention_heads"], shape["num_key_value_heads"], shape["shared_expert_intermediate_size"]
    mats = {"self_attn.q_proj.weight": (2 * H * Dh, D), "self_attn.k_proj.weight": (Hk * Dh, D),
            "self_attn.v_proj.weight": (Hk * Dh, D), "self_attn.o_proj.weight": (D, H * Dh),
            "mlp.gate.weight": (E, D), "mlp.shared_expert_gate.weight": (1, D),
            "mlp.shared_expert.gate_proj.weight": (Is, D), "mlp.shared_expert.up_proj.weight": (Is, D),
            "mlp.shared_expert.down_proj.weight": (D, Is), "mlp.experts.gate_up_proj": (E, 2 * I, D),
            "mlp.experts.down_proj": (E, D, I), "input_layernorm.weight": (D,),
            "post_attention_layernorm.weight": (D,), "self_attn.q_norm.weight": (Dh,), "self_attn.k_norm.weight": (Dh,)}
    t = {f"mtp.layers.0.{k}": 0.1 * rng.standard_normal(s) for k, s in mats.items()}
    t.update({"mtp.fc.weight": 0.1 * rng.standard_normal((D, 2 * D)), "mtp.norm.weight": 0.1 * rng.standard_normal(D),
              "mtp.pre_fc_norm_embedding.weight": 0.1 * rng.standard_normal(D),
              "mtp.pre_fc_norm_hidden.weight": 0.1 * rng.standard_normal(D)})
    save_file({k: v.astype(np.float32) for k, v in t.items()}, str(hf / "model-mtp.safetensors"))
    return t


def make_next_pack(tmp_path, shape: Mapping, seed: int = 0, qtype: str | None = None, name: str = "pack",
                   dtype=None, mtp: bool = False):
    """A pack of a random Qwen3NextForCausalLM of this shape (with an MTP draft layer: mtp) -> (path,
    the float32 transformers model)."""
    from strata.pack import convert
    hf, model = make_next_hf_dir(tmp_path, shape, seed=seed, name=name + "-hf", dtype=dtype)
    if mtp:
        add_mtp_layer(hf, shape, seed=seed + 1)
    return convert(hf, Path(tmp_path) / name, qtype=qtype, progress=False), model


# ---------------------------------------------------------------------------------------------
# GGUF, as llama.cpp's converter writes qwen3next

# kinds llama-quantize leaves in F32: norms, routers, the conv taps and the 1-D ssm parameters
F32_KINDS = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "output_norm", "ssm_norm",
             "ffn_gate_inp", "ffn_gate_inp_shexp", "ssm_conv1d", "ssm_a", "ssm_dt.bias")


def next_gguf_specs(shape: Mapping):
    """(GGUF name, kind, layer, numpy shape) of every tensor of a qwen3next GGUF of this shape."""
    D, V, E, I = shape["hidden_size"], shape["vocab_size"], shape["num_experts"], shape["moe_intermediate_size"]
    H, Hk, Dh, Is = (shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"],
                     shape["shared_expert_intermediate_size"])
    Hg, Hv, Dk, Dv, K = (shape["linear_num_key_heads"], shape["linear_num_value_heads"], shape["linear_key_head_dim"],
                         shape["linear_value_head_dim"], shape["linear_conv_kernel_dim"])
    C = 2 * Hg * Dk + Hv * Dv
    specs = [("token_embd.weight", "token_embd", -1, (V, D)), ("output_norm.weight", "output_norm", -1, (D,)),
             ("output.weight", "output", -1, (V, D))]
    for l in range(shape["num_hidden_layers"]):
        if (l + 1) % shape["full_attention_interval"] == 0:
            mixer = [("attn_q", (2 * H * Dh, D)), ("attn_k", (Hk * Dh, D)), ("attn_v", (Hk * Dh, D)),
                     ("attn_output", (D, H * Dh)), ("attn_q_norm", (Dh,)), ("attn_k_norm", (Dh,))]
        else:
            mixer = [("attn_qkv", (C, D)), ("attn_gate", (Hv * Dv, D)), ("ssm_ba", (2 * Hv, D)),
                     ("ssm_conv1d", (C, K)), ("ssm_a", (Hv,)), ("ssm_dt.bias", (Hv,)), ("ssm_norm", (Dv,)),
                     ("ssm_out", (D, Hv * Dv))]
        ffn = [("post_attention_norm", (D,)), ("ffn_gate_inp", (E, D)), ("ffn_gate_inp_shexp", (1, D)),
               ("ffn_gate_shexp", (Is, D)), ("ffn_up_shexp", (Is, D)), ("ffn_down_shexp", (D, Is)),
               ("ffn_gate_exps", (E, I, D)), ("ffn_up_exps", (E, I, D)), ("ffn_down_exps", (E, D, I))]
        for kind, s in [("attn_norm", (D,))] + mixer + ffn:
            name = kind if kind in ("ssm_a", "ssm_dt.bias") else kind + ".weight"
            specs.append((f"blk.{l}.{name}", kind, l, s))
    return specs


def _random_values(kind: str, qname: str, tshape, rng) -> np.ndarray:
    if kind == "ssm_a":                                   # -exp(A_log) < 0
        return (-rng.uniform(0.5, 8.0, tshape)).astype(np.float32).view(np.uint8)
    if kind == "ssm_dt.bias":
        return (0.5 * rng.standard_normal(tshape)).astype(np.float32).view(np.uint8)
    if kind == "ssm_conv1d":
        return (0.3 * rng.standard_normal(tshape)).astype(np.float32).view(np.uint8)
    if kind == "ffn_gate_inp_shexp":
        return (0.1 * rng.standard_normal(tshape)).astype(np.float32).view(np.uint8)
    return random_tensor_bytes(qname, tshape, rng, "ffn_gate_inp" if kind == "ffn_gate_inp" else
                               ("norm" if kind.endswith("norm") else kind if kind in ("token_embd", "output") else ""))


def _hf_state(shape: Mapping, values: Mapping[str, np.ndarray]) -> dict:
    """transformers' state dict from dequantized GGUF values, by the converter's rules inverted."""
    import torch
    Hg, Hv, Dk, Dv = (shape["linear_num_key_heads"], shape["linear_num_value_heads"], shape["linear_key_head_dim"],
                      shape["linear_value_head_dim"])
    r = Hv // Hg
    st = {"model.embed_tokens.weight": values["token_embd.weight"], "lm_head.weight": values["output.weight"],
          "model.norm.weight": values["output_norm.weight"] - 1}
    for l in range(shape["num_hidden_layers"]):
        g, p = (lambda k: values[f"blk.{l}.{k}"]), f"model.layers.{l}."
        st[p + "input_layernorm.weight"] = g("attn_norm.weight") - 1
        st[p + "post_attention_layernorm.weight"] = g("post_attention_norm.weight") - 1
        if (l + 1) % shape["full_attention_interval"] == 0:
            for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
                st[p + f"self_attn.{hf}.weight"] = g(gg + ".weight")
            st[p + "self_attn.q_norm.weight"] = g("attn_q_norm.weight") - 1
            st[p + "self_attn.k_norm.weight"] = g("attn_k_norm.weight") - 1
        else:
            qkv, z = g("attn_qkv.weight"), g("attn_gate.weight")
            D = qkv.shape[1]
            q, k, v = qkv[:Hg * Dk], qkv[Hg * Dk:2 * Hg * Dk], qkv[2 * Hg * Dk:]
            per = [q.reshape(Hg, Dk, D), k.reshape(Hg, Dk, D), v.reshape(Hg, r * Dv, D), z.reshape(Hg, r * Dv, D)]
            st[p + "linear_attn.in_proj_qkvz.weight"] = np.concatenate(per, axis=1).reshape(-1, D)
            st[p + "linear_attn.in_proj_ba.weight"] = g("ssm_ba.weight")
            st[p + "linear_attn.conv1d.weight"] = g("ssm_conv1d.weight")[:, None, :]
            st[p + "linear_attn.A_log"] = np.log(-g("ssm_a"))
            st[p + "linear_attn.dt_bias"] = g("ssm_dt.bias")
            st[p + "linear_attn.norm.weight"] = g("ssm_norm.weight")
            st[p + "linear_attn.out_proj.weight"] = g("ssm_out.weight")
        st[p + "mlp.gate.weight"] = g("ffn_gate_inp.weight")
        st[p + "mlp.shared_expert_gate.weight"] = g("ffn_gate_inp_shexp.weight").reshape(1, -1)
        for part in ("gate", "up", "down"):
            st[p + f"mlp.shared_expert.{part}_proj.weight"] = g(f"ffn_{part}_shexp.weight")
        st[p + "mlp.experts.gate_up_proj"] = np.concatenate([g("ffn_gate_exps.weight"), g("ffn_up_exps.weight")], axis=1)
        st[p + "mlp.experts.down_proj"] = g("ffn_down_exps.weight")
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in st.items()}


def _gguf_next_metadata(w, shape: Mapping) -> None:
    """The qwen3next keys llama.cpp's converter adds to the qwen2moe ones."""
    a = "qwen3next"
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", shape["shared_expert_intermediate_size"])
    w.add_uint32(f"{a}.ssm.conv_kernel", shape["linear_conv_kernel_dim"])
    w.add_uint32(f"{a}.ssm.state_size", shape["linear_key_head_dim"])
    w.add_uint32(f"{a}.ssm.group_count", shape["linear_num_key_heads"])
    w.add_uint32(f"{a}.ssm.time_step_rank", shape["linear_num_value_heads"])
    w.add_uint32(f"{a}.ssm.inner_size", shape["linear_value_head_dim"] * shape["linear_num_value_heads"])
    w.add_uint32(f"{a}.full_attention_interval", shape["full_attention_interval"])
    w.add_uint32(f"{a}.rope.dimension_count",
                 int(shape["head_dim"] * shape["rope_parameters"]["partial_rotary_factor"]))
    w.add_bool(f"{a}.expert_weights_norm", bool(shape["norm_topk_prob"]))


class _Renamed:
    """A GGUFWriter whose keys `qwen3moe.*` become `qwen3next.*` (tests.fixtures writes qwen3moe's)."""

    def __init__(self, w):
        self.w = w

    def __getattr__(self, name):
        fn = getattr(self.w, name)
        if not name.startswith("add_"):
            return fn
        return lambda key, *a, **k: fn(key.replace("qwen3moe.", "qwen3next.", 1) if isinstance(key, str) else key,
                                       *a, **k)


def make_next_gguf(tmp_path, shape: Mapping, qtypes: Mapping[str, object], seed: int = 0, name: str = "model"):
    """A qwen3next GGUF with random valid blocks; qtypes maps a kind (GGUF name inside blk.N without
    .weight, or token_embd/output) to a type or a per-layer list (cycled); F32_KINDS are F32.
    Returns (path, the Qwen3NextForCausalLM holding the dequantized weights)."""
    import gguf
    from transformers import Qwen3NextForCausalLM
    from strata.quant import qtype as qtype_of
    rng = np.random.default_rng(seed)
    path = Path(tmp_path) / f"{name}.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(path, "qwen3next")
    gshape = dict(shape, rope_theta=shape["rope_parameters"]["rope_theta"], head_dim=shape["head_dim"])
    tok = make_tokenizer(shape["vocab_size"])
    _gguf_metadata(_Renamed(w), gshape, tok, name)      # the qwen2moe/qwen3moe keys, under qwen3next.*
    _gguf_next_metadata(w, shape)
    values = {}
    for tname, kind, layer, tshape in next_gguf_specs(shape):
        v = "F32" if kind in F32_KINDS else qtypes.get(kind, "Q8_0")
        qname = (v[max(layer, 0) % len(v)] if isinstance(v, (list, tuple)) else v).upper()
        data = _random_values(kind, qname, tshape, rng)
        rows = data.reshape(*tshape[:-1], qtype_of(qname).row_bytes(tshape[-1]))
        w.add_tensor(tname, rows, raw_dtype=gguf.GGMLQuantizationType[qname])
        values[tname] = dequantize_bytes(qname, data, tshape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model = Qwen3NextForCausalLM(_with_ids(shape, tok))
    model.load_state_dict(_hf_state(shape, values), strict=True)
    return path, model.float().eval()


__all__ = ["NEXT_SHAPES", "make_next_hf_dir", "make_next_pack", "make_next_gguf", "next_gguf_specs"]
