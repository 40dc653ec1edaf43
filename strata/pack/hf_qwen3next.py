"""A Hugging Face Qwen3NextForCausalLM checkpoint directory as a conversion Source.

Tensors get the names and values llama.cpp's converter gives them (strata.pack.qwen3next_names says
which rules), so one model file serves the HF and the GGUF routes. Reading, quantizing and the expert
layouts are hf_source's.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import ModelArgs
from ..errors import FormatError, InvalidArgument, UnsupportedError
from . import qwen3next_names as names
from .checks import model_args_problem, rope_scaling_problem
from .hf_source import _expert_layer, _Plan, _quantize_rows, _Tensors, source_files, to_float32
from .source import Source, TensorSpec
from .tokenizer_build import _read_json, hf_tokenizer

ARCHITECTURE = "Qwen3NextForCausalLM"
KEEP_F32 = ("ffn_gate_inp", "ffn_gate_inp_shexp", "ssm_conv1d")     # the routers and the K-tap conv


def _interval(src: Path, cfg: dict, num_layers: int) -> int:
    """full_attention_interval, checked against layer_types when the config lists them."""
    interval = int(cfg.get("full_attention_interval") or 4)
    types = cfg.get("layer_types")
    if types is not None:
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        interval = full[0] + 1 if full else num_layers + 1
        want = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
        if list(types) != want:
            raise UnsupportedError(f"{src}/config.json: layer_types are not one full-attention layer every "
                                   f"{interval} layers ({types[:8]}...)")
    return interval


def _rope(src: Path, cfg: dict) -> tuple[float, float, dict | None]:
    rope = dict(cfg.get("rope_parameters") or {})
    theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    factor = float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
    scaling = cfg.get("rope_scaling") or ({k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
                                          if rope.get("rope_type", "default") != "default" else None)
    problem = rope_scaling_problem(scaling)
    if problem:
        raise FormatError(f"{src}/config.json: {problem}")
    return theta, factor, scaling


def model_args(src: Path, cfg: dict) -> ModelArgs:
    if cfg.get("mlp_only_layers"):
        raise UnsupportedError(f"{src}: dense MLP layers (mlp_only_layers={cfg['mlp_only_layers']}) are not supported")
    if int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise UnsupportedError(f"{src}: decoder_sparse_step={cfg['decoder_sparse_step']} is not supported (only 1)")
    if cfg.get("attention_bias"):
        raise UnsupportedError(f"{src}: attention biases (attention_bias) are not supported")
    num_mtp = int(cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers") or 0)
    if num_mtp > 1:
        raise UnsupportedError(f"{src}: {num_mtp} MTP layers; Strata supports at most 1")
    theta, factor, scaling = _rope(src, cfg)
    try:
        D, H, L = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), int(cfg["num_hidden_layers"])
        args = ModelArgs(
            architecture="qwen3next", vocab_size=int(cfg["vocab_size"]), hidden_size=D, num_hidden_layers=L,
            num_attention_heads=H, num_key_value_heads=int(cfg.get("num_key_value_heads") or H),
            head_dim=int(cfg.get("head_dim") or D // H), num_experts=int(cfg["num_experts"]),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=scaling, norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), num_mtp_layers=num_mtp,
            full_attention_interval=_interval(src, cfg, L), partial_rotary_factor=factor,
            linear_num_key_heads=int(cfg["linear_num_key_heads"]),
            linear_num_value_heads=int(cfg["linear_num_value_heads"]),
            linear_key_head_dim=int(cfg["linear_key_head_dim"]),
            linear_value_head_dim=int(cfg["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(cfg["linear_conv_kernel_dim"]),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0))
    except KeyError as e:
        raise FormatError(f"{src}/config.json: missing key {e.args[0]}") from None
    except InvalidArgument as e:
        raise FormatError(f"{src}/config.json: {e}") from None
    except (TypeError, ValueError, OverflowError, ZeroDivisionError) as e:
        raise FormatError(f"{src}/config.json: a model number is not a number ({e})") from None
    problem = model_args_problem(args)
    if problem:
        raise FormatError(f"{src}/config.json: {problem}")
    return args


def _stored_shape(kind: str, shape: tuple, args: ModelArgs) -> tuple:
    """The HF shape behind a pack tensor of this kind and shape."""
    if kind in ("attn_qkv", "attn_gate"):                               # both from in_proj_qkvz
        return 2 * args.linear_num_key_heads * args.linear_key_head_dim + \
            2 * args.linear_num_value_heads * args.linear_value_head_dim, shape[1]
    if kind == "ssm_conv1d":
        return shape[0], 1, shape[1]
    return shape


def _transform(kind: str, w: np.ndarray, args: ModelArgs) -> np.ndarray:
    """The llama.cpp converter's value rules (qwen3next_names) on one float32 HF tensor."""
    if kind in ("attn_qkv", "attn_gate"):
        Hg, Dk = args.linear_num_key_heads, args.linear_key_head_dim
        vz = args.linear_num_value_heads // Hg * args.linear_value_head_dim
        per = w.reshape(Hg, 2 * Dk + 2 * vz, -1)                         # per key head [q | k | v | z]
        if kind == "attn_gate":
            return per[:, 2 * Dk + vz:].reshape(-1, w.shape[-1])
        q, k, v = per[:, :Dk], per[:, Dk:2 * Dk], per[:, 2 * Dk:2 * Dk + vz]
        return np.concatenate([q.reshape(-1, w.shape[-1]), k.reshape(-1, w.shape[-1]), v.reshape(-1, w.shape[-1])])
    if kind == "ssm_a":
        return -np.exp(w)
    if kind == "ssm_conv1d":
        return w.reshape(w.shape[0], w.shape[2])
    if kind in names.PLUS_ONE:
        return w + np.float32(1.0)
    return w


_CHANGED = ("attn_qkv", "attn_gate", "ssm_a", "ssm_conv1d", *names.PLUS_ONE)


def _dense_spec(plan: _Plan, args: ModelArgs, name: str, shape: tuple) -> TensorSpec:
    hf, kind = names.hf_name(name, args.num_hidden_layers)
    st = plan.t.get(hf, _stored_shape(kind, shape, args))
    if kind not in _CHANGED:
        target = plan.target(name, st.dtype, shape, keep_f32=kind in KEEP_F32)
        return TensorSpec(name, target, shape, plan.reader(st, target, shape))
    target = "F32" if plan.qtype is None or kind in KEEP_F32 else plan.target(name, "F32", shape, keep_f32=False)

    def read():
        w = _transform(kind, to_float32(st.dtype, plan.t.raw(st), st.shape).astype(np.float32), args)
        w = np.ascontiguousarray(w, dtype=np.float32).reshape(shape)
        if target == "F32":
            return w.view(np.uint8).reshape(-1)
        raw = w.astype("<f4").view(np.uint8).reshape(-1)
        return _quantize_rows(target, "F32", raw, shape)
    return TensorSpec(name, target, shape, read)


def open_qwen3next_source(src, qtype: str | None = None) -> Source:
    """The Source of a HF Qwen3NextForCausalLM checkpoint directory (config.json + *.safetensors)."""
    src = Path(src)
    cfg = _read_json(src / "config.json", required=True)
    args = model_args(src, cfg)
    tensors, notes = _Tensors(src), []
    plan = _Plan(tensors, qtype, notes)
    dense = [_dense_spec(plan, args, name, shape) for name, shape in names.dense_shapes(args).items()]
    L = args.num_hidden_layers
    experts = [_expert_layer(plan, f"model.layers.{l}.mlp.experts" if l < L else "mtp.layers.0.mlp.experts", args, l)
               for l in range(L + args.num_mtp_layers)]
    tok_meta, tok_json = hf_tokenizer(src, cfg)
    source = Source("hf", source_files(src), args, dense, experts, tok_meta, tok_json, notes)
    source._closers.append(tensors.close)
    return source


def is_qwen3next(src: Path) -> bool:
    cfg = _read_json(Path(src) / "config.json") or {}
    return ARCHITECTURE in (cfg.get("architectures") or []) or cfg.get("model_type") == "qwen3_next"
