"""A qwen3next GGUF (llama.cpp's Qwen3-Next; single file or splits) as a conversion Source.

Tensor names, shapes and values are those llama.cpp's convert_hf_to_gguf.py writes (see
strata/pack/qwen3next_names.py), kept as block bytes. The model numbers come from the qwen2moe keys
plus qwen3next's: ssm.conv_kernel (K), ssm.state_size (Dk), ssm.group_count (key heads),
ssm.time_step_rank (value heads), ssm.inner_size (value heads x Dv), full_attention_interval and
rope.dimension_count (the rotary dims: head_dim x partial_rotary_factor).
"""
from __future__ import annotations

from pathlib import Path

from ..config import ModelArgs
from ..errors import FormatError, InvalidArgument, UnsupportedError
from .checks import model_args_problem
from .gguf_file import read_gguf
from .gguf_source import _block_count, _checked, _dims, _expert_spec, _merge_splits, _Meta, _rope_scaling, split_paths
from .qwen3next_names import dense_shapes
from .source import EXPERT_PARTS, Source, TensorSpec, expert_shapes
from .tokenizer_build import gguf_tokenizer

ARCH = "qwen3next"


def _model_args(g, tensors: dict) -> ModelArgs:
    m = _Meta(g, ARCH)
    block_count, num_mtp = _block_count(g, m, tensors), m.get("nextn_predict_layers", 0)
    if num_mtp > 1:
        raise UnsupportedError(f"{g.path}: {num_mtp} MTP layers; Strata supports at most 1")
    num_layers = block_count - num_mtp if num_mtp else block_count
    if any(n.endswith("ffn_gate_up_exps.weight") for n in tensors):
        raise UnsupportedError(f"{g.path}: fused ffn_gate_up_exps experts are not supported (separate gate/up are)")
    embd = _dims(g, tensors, "token_embd.weight", 2)
    if embd is None:
        raise FormatError(f"{g.path}: missing tensor token_embd.weight")
    D, H = m.get("embedding_length"), m.get("attention.head_count")
    interval = m.get("full_attention_interval", 4)
    q_norm = _dims(g, tensors, f"blk.{interval - 1}.attn_q_norm.weight", 1)
    head_dim = m.get("attention.key_length", q_norm[0] if q_norm else D // max(H, 1))
    Hv = m.get("ssm.time_step_rank")
    try:
        args = ModelArgs(
            architecture=ARCH, vocab_size=embd[0], hidden_size=D, num_hidden_layers=num_layers,
            num_attention_heads=H, num_key_value_heads=m.get("attention.head_count_kv", H), head_dim=head_dim,
            num_experts=m.get("expert_count"), num_experts_per_tok=m.get("expert_used_count"),
            moe_intermediate_size=m.get("expert_feed_forward_length"),
            rms_norm_eps=m.get("attention.layer_norm_rms_epsilon", 1e-6, float),
            rope_theta=m.get("rope.freq_base", 10000.0, float), rope_scaling=_rope_scaling(m),
            norm_topk_prob=m.get("expert_weights_norm", True, bool),
            max_position_embeddings=m.get("context_length", 32768),
            tie_word_embeddings="output.weight" not in tensors, num_mtp_layers=num_mtp,
            full_attention_interval=interval,
            partial_rotary_factor=m.get("rope.dimension_count", head_dim) / max(head_dim, 1),
            linear_num_key_heads=m.get("ssm.group_count"), linear_num_value_heads=Hv,
            linear_key_head_dim=m.get("ssm.state_size"), linear_value_head_dim=m.get("ssm.inner_size") // max(Hv, 1),
            linear_conv_kernel_dim=m.get("ssm.conv_kernel"),
            shared_expert_intermediate_size=m.get("expert_shared_feed_forward_length", 0))
    except InvalidArgument as e:
        raise FormatError(f"{g.path}: inconsistent metadata: {e}") from None
    problem = model_args_problem(args)
    if problem:
        raise FormatError(f"{g.path}: unusable model numbers in the metadata: {problem}")
    return args


def open_qwen3next_gguf(path) -> Source:
    """The Source of a qwen3next GGUF file (any split of a split GGUF names the whole set)."""
    path = Path(path)
    files = [read_gguf(p) for p in split_paths(path)]
    try:
        tensors = _merge_splits(files)
        args = _model_args(files[0], tensors)
        shapes = dense_shapes(args)
        layers = range(args.num_hidden_layers + args.num_mtp_layers)
        needed = list(shapes) + [f"blk.{l}.ffn_{p}_exps.weight" for l in layers for p in EXPERT_PARTS]
        missing = [n for n in needed if n not in tensors]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise FormatError(f"{files[0].path}: missing tensors {', '.join(missing[:5])}{more}")
        dense = []
        for name, shape in shapes.items():
            stored = tensors[name][1].shape
            if name.endswith("ffn_gate_inp_shexp.weight") and stored == shape[1:]:
                stored = shape                  # [D] and [1, D] are the same bytes
            part, info = _checked(files[0], tensors, name, stored)
            dense.append(TensorSpec(name, info.qtype, shape, lambda p=part, i=info: p.tensor_bytes(i)))
        exp_shapes = expert_shapes(args)
        experts = []
        for l in layers:
            specs = {}
            for p in EXPERT_PARTS:
                part, info = _checked(files[0], tensors, f"blk.{l}.ffn_{p}_exps.weight",
                                      (args.num_experts, *exp_shapes[p]))
                specs[p] = _expert_spec(part, info, exp_shapes[p])
            experts.append(specs)
        tok_meta, tok_json = gguf_tokenizer(files[0].kv, files[0].path, args.vocab_size)
    except BaseException:
        for f in files:
            f.close()
        raise
    src = Source("gguf", [f.path for f in files], args, dense, experts, tok_meta, tok_json)
    src._closers += [f.close for f in files]
    return src


def is_qwen3next_gguf(path) -> bool:
    g = read_gguf(split_paths(Path(path))[0])
    try:
        return g.kv.get("general.architecture") == ARCH
    finally:
        g.close()
