"""Planner sizes of a qwen3next pack as the memory model can run them (its dry run still runs qwen3moe).

memory_model prices the prompt and decode scratch by running the qwen3moe model over DeviceOps on
null buffers. For qwen3next it runs a stand-in: a qwen3moe of the same width, heads, experts and
vocabulary whose every layer is the pack's gated-attention layer (attn_q at its query half), so
each DeltaNet layer's scratch is priced as an attention layer's; the routed experts, and their
blobs, are the pack's own. The DeltaNet layers' fixed states are priced with the KV
(strata.engine.planner.kv_bytes), which counts only the attention layers' cells.
"""
from __future__ import annotations

import dataclasses

from ..config import ModelArgs
from ..pack.source import dense_shapes
from ..quant import tensor_bytes

_SAME_ARGS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "rms_norm_eps",
              "rope_theta", "rope_scaling", "norm_topk_prob", "max_position_embeddings", "tie_word_embeddings",
              "num_mtp_layers")


def linear_state_bytes(args: ModelArgs) -> int:
    """float32 conv and recurrent state of every DeltaNet layer of one sequence."""
    if args.architecture != "qwen3next":
        return 0
    conv = (args.linear_conv_kernel_dim - 1) * (2 * args.linear_num_key_heads * args.linear_key_head_dim
                                               + args.linear_num_value_heads * args.linear_value_head_dim)
    ssm = args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim
    num = sum(not args.is_full_attention(l) for l in range(args.num_hidden_layers))
    return 4 * num * (conv + ssm)


def attention_layers(args: ModelArgs, num_layers: int) -> int:
    """How many of the first num_layers layers (MTP included) keep K/V."""
    return sum(args.is_full_attention(l) for l in range(num_layers))


def qwen3moe_stand_in(sizes):
    """sizes itself for qwen3moe; for qwen3next the stand-in of the module doc."""
    a = sizes.args
    if a.architecture != "qwen3next":
        return sizes
    args = ModelArgs(architecture="qwen3moe", **{k: getattr(a, k) for k in _SAME_ARGS})
    full = a.full_attention_interval - 1                         # the first gated-attention layer
    dense = {}
    for name, shape in dense_shapes(args).items():
        parts = name.split(".")
        if parts[0] == "blk" and parts[2].startswith("attn_") and parts[2] != "attn_norm":
            parts[1] = str(full if int(parts[1]) < a.num_hidden_layers else parts[1])
        if parts[0] == "blk" and parts[2] == "ffn_norm":
            parts[2] = "post_attention_norm"
        qtype = sizes.dense[".".join(parts)]["qtype"]
        dense[name] = {"qtype": qtype, "shape": list(shape), "offset": 0, "nbytes": tensor_bytes(qtype, shape)}
    return dataclasses.replace(sizes, args=args, dense=dense)
