"""Packs of random weights in a real model's shape, for measuring speed without a download.

`synthetic_pack("qwen3-30b-a3b")` builds exactly the tensors, quant types and sizes of the model
docs/PERF.md compares against (random valid block bytes, sane scales, so routing is near uniform),
writes it once into the cache directory and reuses it after.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .config import ModelArgs
from .errors import InvalidArgument
from .pack.source import EXPERT_PARTS, ExpertSpec, Source, TensorSpec, dense_shapes, expert_shapes
from .quant.random import random_qtensor_bytes

FORMAT_TAG = "v1"     # bump when what a shape generates changes, so cached packs are rebuilt


def _args(**kw) -> ModelArgs:
    base = dict(architecture="qwen3moe", rms_norm_eps=1e-6, rope_theta=1e6, norm_topk_prob=True,
                max_position_embeddings=40960, tie_word_embeddings=False)
    return ModelArgs(**{**base, **kw})


# name -> (ModelArgs, quant type per tensor group)
SHAPES: dict[str, tuple[ModelArgs, dict[str, str]]] = {
    # Qwen3-30B-A3B as in docs/PERF.md: experts Q4_K; attention, embedding and head Q8_0; norms and router F32.
    "qwen3-30b-a3b": (_args(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                            num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=768),
                      {"experts": "Q4_K", "attn": "Q8_0", "embd": "Q8_0", "output": "Q8_0"}),
    # Qwen3-Next-80B-A3B (its HF config, the MTP layer included): a typical Q4_K_M-style mix of our choosing,
    # routed experts Q4_K; attention and DeltaNet projections Q8_0; shared expert and embedding Q6_K;
    # head Q8_0; norms, routers, conv taps and ssm_a / ssm_dt F32.
    "qwen3-next-80b-a3b": (_args(architecture="qwen3next", vocab_size=151936, hidden_size=2048,
                                 num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                 num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                                 rope_theta=1e7, max_position_embeddings=262144, num_mtp_layers=1,
                                 full_attention_interval=4, partial_rotary_factor=0.25, linear_num_key_heads=16,
                                 linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                                 linear_conv_kernel_dim=4, shared_expert_intermediate_size=512),
                           {"experts": "Q4_K", "attn": "Q8_0", "shexp": "Q6_K", "embd": "Q6_K", "output": "Q8_0"}),
    # The 30B shape plus one MTP draft layer of the same layer shape (Qwen3-Next / DeepSeek style), so
    # speculation's window costs and the drafter's VRAM can be measured at 30B sizes.
    "qwen3-30b-a3b-mtp": (_args(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                                num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                moe_intermediate_size=768, num_mtp_layers=1),
                          {"experts": "Q4_K", "attn": "Q8_0", "embd": "Q8_0", "output": "Q8_0"}),
    # The 30B shape with the YaRN scaling Qwen3's model card gives for long inputs (factor 4 over its
    # 32,768 original positions: a 131,072-token context), for the long-context runs of quantized K/V.
    "qwen3-30b-a3b-128k": (_args(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                                 num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                 moe_intermediate_size=768, max_position_embeddings=131072,
                                 rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 32768}),
                           {"experts": "Q4_K", "attn": "Q8_0", "embd": "Q8_0", "output": "Q8_0"}),
    # The same kinds at about 1/20 of the bytes, for quick runs.
    "small": (_args(vocab_size=32768, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                    num_key_value_heads=2, head_dim=64, num_experts=32, num_experts_per_tok=4,
                    moe_intermediate_size=512),
              {"experts": "Q4_K", "attn": "Q8_0", "embd": "Q8_0", "output": "Q8_0"}),
    # Seconds on a CPU: for tests of the bench itself.
    "tiny": (_args(vocab_size=8192, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=256, max_position_embeddings=4096),
             {"experts": "Q4_K", "attn": "Q8_0", "embd": "Q8_0", "output": "Q8_0"}),
    "tiny-mtp": (_args(vocab_size=8192, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=256, max_position_embeddings=4096, num_mtp_layers=1),
                 {"experts": "Q4_K", "attn": "Q8_0", "embd": "Q8_0", "output": "Q8_0"}),
}

_GROUP = {"attn_q": "attn", "attn_k": "attn", "attn_v": "attn", "attn_output": "attn", "token_embd": "embd",
          "output": "output", "nextn.eh_proj": "attn", "ffn_gate_shexp": "shexp", "ffn_up_shexp": "shexp",
          "ffn_down_shexp": "shexp"}
_F32 = ("ffn_gate_inp", "ffn_gate_inp_shexp", "ssm_conv1d")      # routers and qwen3next's 4-tap conv


def _kind(name: str) -> str:
    stem = name[: -len(".weight")] if name.endswith(".weight") else name
    return stem.split(".", 2)[2] if stem.startswith("blk.") else stem


def _vector(kind: str, shape, rng) -> np.ndarray:
    """1-D tensors: norms around 1, as trained models have them; ssm_a = -exp(A_log) < 0."""
    if kind == "ssm_a":
        return -rng.uniform(1.0, 16.0, shape).astype(np.float32)
    if kind == "ssm_dt.bias":
        return rng.uniform(-1.0, 1.0, shape).astype(np.float32)
    return (1.0 + 0.05 * rng.standard_normal(shape)).astype(np.float32)


def _seed(*parts) -> np.random.Generator:
    return np.random.default_rng(list(parts))


def synthetic_source(shape: str, seed: int = 0) -> Source:
    """A Source of random weights for one of SHAPES (read lazily, one tensor or expert at a time)."""
    if shape not in SHAPES:
        raise InvalidArgument(f"unknown synthetic shape {shape!r} (known: {', '.join(SHAPES)})")
    args, qtypes = SHAPES[shape]
    dense = []
    for i, (name, tshape) in enumerate(dense_shapes(args).items()):
        kind = _kind(name)
        if len(tshape) == 1:
            read = (lambda s=tshape, i=i, k=kind: _vector(k, s, _seed(seed, 1, i)).view(np.uint8).reshape(-1))
            dense.append(TensorSpec(name, "F32", tshape, read))
        else:
            qt = "F32" if kind in _F32 else qtypes.get(_GROUP.get(kind, "attn"), "Q8_0")
            read = (lambda q=qt, s=tshape, i=i: random_qtensor_bytes(q, s, _seed(seed, 2, i), 0.02))
            dense.append(TensorSpec(name, qt, tshape, read))
    experts = []
    for layer in range(args.num_hidden_layers + args.num_mtp_layers):
        parts = {}
        for j, (part, pshape) in enumerate(expert_shapes(args).items()):
            read = (lambda e, q=qtypes["experts"], s=pshape, l=layer, j=j:
                    random_qtensor_bytes(q, s, _seed(seed, 3, l, j, e), 0.02))
            parts[part] = ExpertSpec(qtypes["experts"], pshape, read)
        experts.append({p: parts[p] for p in EXPERT_PARTS})
    demo = Path(__file__).resolve().parent / "demo"
    import json
    tok_meta = json.loads((demo / "pack.json").read_text())["tokenizer"]
    tok_meta = {k: v for k, v in tok_meta.items() if k != "file"}
    return Source(kind="synthetic", paths=[], args=args, dense=dense, experts=experts,
                  tokenizer_meta=tok_meta, tokenizer_json=lambda: (demo / "tokenizer.json").read_text())


def synthetic_pack(shape: str, cache_dir: str | None = None, progress: bool = True, seed: int = 0) -> Path:
    """The cached pack of a synthetic shape, built on first use (seconds per GB)."""
    from .pack.cache import default_cache_dir
    from .pack.converter import write_source
    from .pack.format import is_pack_dir
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    dst = root / f"synthetic-{shape}-{FORMAT_TAG}-seed{seed}"
    if is_pack_dir(dst):
        return dst
    return write_source(synthetic_source(shape, seed), dst, f"building synthetic {shape}", progress)
