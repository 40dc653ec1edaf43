"""What the planner counts of a qwen3next pack beyond qwen3moe's: K/V in the gated-attention layers
only (attention_layers) and each DeltaNet layer's fixed f32 conv and recurrent state
(linear_state_bytes), both priced with the KV (strata.engine.planner.kv_bytes). The prompt and
decode scratch is the dry run of the pack's own forward (strata.engine.memory_model).
"""
from __future__ import annotations

from ..config import ModelArgs


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
