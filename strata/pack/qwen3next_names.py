"""qwen3next tensor names and shapes, llama.cpp's, and the HF checkpoint names they come from.

The rules matched are those of llama.cpp's convert_hf_to_gguf.py for Qwen3NextForCausalLM (read, not
copied): `linear_attn.in_proj_qkvz` (per key head [q | k | v | z]) is split into `attn_qkv` (all q
heads, then all k, then all v) and `attn_gate` (z); `in_proj_ba` is kept as `ssm_ba` (per key head
[b | a]); `A_log` becomes `ssm_a` = -exp(A_log); `dt_bias` becomes `ssm_dt.bias`; the conv1d weight
[C, 1, K] is squeezed to [C, K]; every `*norm.weight` except the DeltaNet's own `linear_attn.norm` is
stored as 1 + w (the model's norms are zero-centred); `post_attention_layernorm` is
`post_attention_norm`; the shared expert is `ffn_{gate,up,down}_shexp` with its gate
`ffn_gate_inp_shexp` [1, D]. llama.cpp's converter drops the `mtp.*` tensors; here the HF route keeps
them as the blk.L.nextn.* names of qwen3moe packs.
"""
from __future__ import annotations

from ..config import ModelArgs

ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm")
DELTA_NET = ("attn_qkv", "attn_gate", "ssm_ba", "ssm_conv1d", "ssm_a", "ssm_dt.bias", "ssm_norm", "ssm_out")
FFN = ("ffn_gate_inp", "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
NEXTN = ("nextn.eh_proj", "nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm")


def full_name(kind: str) -> str:
    """ssm_a and ssm_dt.bias carry no .weight suffix in llama.cpp's names."""
    return kind if kind in ("ssm_a", "ssm_dt.bias") else kind + ".weight"


def layer_kinds(args: ModelArgs, layer: int) -> tuple[str, ...]:
    mixer = ATTENTION if args.is_full_attention(layer) else DELTA_NET
    ffn = FFN if args.shared_expert_intermediate_size else FFN[:1]
    return ("attn_norm", *mixer, "post_attention_norm", *ffn,
            *(NEXTN if layer >= args.num_hidden_layers else ()))


def dense_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every dense tensor of a qwen3next pack, in pack order, with its numpy shape."""
    D, V, E, Is = args.hidden_size, args.vocab_size, args.num_experts, args.shared_expert_intermediate_size
    H, Hk, Dh = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    Hg, Hv, Dk, Dv = (args.linear_num_key_heads, args.linear_num_value_heads, args.linear_key_head_dim,
                      args.linear_value_head_dim)
    conv = 2 * Hg * Dk + Hv * Dv
    per_kind = {
        "attn_norm": (D,), "post_attention_norm": (D,), "attn_q": (2 * H * Dh, D), "attn_k": (Hk * Dh, D),
        "attn_v": (Hk * Dh, D), "attn_output": (D, H * Dh), "attn_q_norm": (Dh,), "attn_k_norm": (Dh,),
        "attn_qkv": (conv, D), "attn_gate": (Hv * Dv, D), "ssm_ba": (2 * Hv, D),
        "ssm_conv1d": (conv, args.linear_conv_kernel_dim), "ssm_a": (Hv,), "ssm_dt.bias": (Hv,),
        "ssm_norm": (Dv,), "ssm_out": (D, Hv * Dv), "ffn_gate_inp": (E, D), "ffn_gate_inp_shexp": (1, D),
        "ffn_gate_shexp": (Is, D), "ffn_up_shexp": (Is, D), "ffn_down_shexp": (D, Is),
        "nextn.eh_proj": (D, 2 * D), "nextn.enorm": (D,), "nextn.hnorm": (D,), "nextn.shared_head_norm": (D,)}
    out = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
    if not args.tie_word_embeddings:
        out["output.weight"] = (V, D)
    for layer in range(args.num_hidden_layers + args.num_mtp_layers):
        for kind in layer_kinds(args, layer):
            out[f"blk.{layer}.{full_name(kind)}"] = per_kind[kind]
    return out


# pack kind -> the HF name inside model.layers.{l} (attn_qkv and attn_gate both come from in_proj_qkvz)
HF_LAYER = {
    "attn_norm": "input_layernorm.weight", "post_attention_norm": "post_attention_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight", "attn_k": "self_attn.k_proj.weight", "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight", "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight", "attn_qkv": "linear_attn.in_proj_qkvz.weight",
    "attn_gate": "linear_attn.in_proj_qkvz.weight", "ssm_ba": "linear_attn.in_proj_ba.weight",
    "ssm_conv1d": "linear_attn.conv1d.weight", "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm": "linear_attn.norm.weight", "ssm_out": "linear_attn.out_proj.weight",
    "ffn_gate_inp": "mlp.gate.weight", "ffn_gate_inp_shexp": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj.weight", "ffn_up_shexp": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp": "mlp.shared_expert.down_proj.weight",
}
HF_FIXED = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight", "nextn.eh_proj": "mtp.fc.weight",
            "nextn.enorm": "mtp.pre_fc_norm_embedding.weight", "nextn.hnorm": "mtp.pre_fc_norm_hidden.weight",
            "nextn.shared_head_norm": "mtp.norm.weight"}
# pack kinds stored as 1 + w (zero-centred RMSNorm weights)
PLUS_ONE = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "output_norm",
            "nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm")


def hf_name(pack_name: str, num_layers: int) -> tuple[str, str]:
    """(HF checkpoint name, pack kind) of a pack dense tensor."""
    if not pack_name.startswith("blk."):
        return HF_FIXED[pack_name], pack_name.rsplit(".", 1)[0]
    _, layer, rest = pack_name.split(".", 2)
    kind = rest if rest in ("ssm_a", "ssm_dt.bias") else rest.rsplit(".", 1)[0]
    if kind in HF_FIXED:
        return HF_FIXED[kind], kind
    prefix = "mtp.layers.0" if int(layer) >= num_layers else f"model.layers.{layer}"
    return f"{prefix}.{HF_LAYER[kind]}", kind
