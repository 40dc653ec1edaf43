"""The per-tensor quant types llama.cpp's `llama-quantize` chooses for a qwen3moe model, per preset.

Our own table of the choices that llama.cpp's src/llama-quant.cpp makes (read at ggml-org/llama.cpp
commit 007dbbf3fd17: `llama_ftype_get_default_type`, `llama_tensor_get_type_impl`,
`tensor_allows_quantization`, `tensor_type_fallback`), for the presets Strata's types can hold and
the tensors a qwen3moe GGUF has, without an importance matrix:

- every 2D/3D `*.weight` takes the preset's default type, except norms and the router
  (ffn_gate_inp), which keep their source type (F32 here);
- output.weight: Q8_0 if its rows do not fill the default type's blocks or the default is Q8_0,
  else Q6_K; token_embd.weight (untied): the default type;
- attn_v, attn_k, attn_output and ffn_down_exps move up for some presets, by layer index i of
  n layers where marked (`more_bits(i, n)` is llama.cpp's use_more_bits; attn_v's index counts the
  attn_v tensors, which is the layer for qwen3moe); the n_expert == 8 rules are kept, though
  qwen3moe models have 128 experts;
- a row length the chosen type's blocks do not divide falls back (Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0,
  Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL, then F16).

Besides those: Q4_1, Q5_0, Q5_1, F16 and BF16 (OTHER_PRESETS). `pure=True` is `llama-quantize
--pure`: every quantized tensor, output and embedding included, in the default type (then the
fallback).
"""
from __future__ import annotations

from typing import Mapping

from strata.quant import qtype

DEFAULT_TYPE = {"Q2_K": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K", "Q4_0": "Q4_0",
                "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K",
                "Q8_0": "Q8_0", "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS"}
PRESETS = tuple(DEFAULT_TYPE)
# The presets of the other types Strata reads: their files differ from a --pure one only in the head
# (Q6_K, or the float type itself for F16 and BF16, which llama-quantize does not requantize by rule)
OTHER_PRESETS = {"Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1", "F16": "F16", "BF16": "BF16"}
DEFAULT_TYPE.update(OTHER_PRESETS)
UNQUANTIZED = ("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm", "output_norm", "ffn_gate_inp")
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL"}


def more_bits(i: int, n: int) -> bool:
    """Layers that get more bits: the first and last eighth, and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _attn_v(preset: str, t: str, i: int, n: int, n_gqa: int, n_expert: int) -> str:
    if preset == "Q2_K":
        t = "Q4_K" if n_gqa >= 4 else "Q3_K"
    elif preset == "Q3_K_M":
        t = "Q5_K" if i < 2 else "Q4_K"
    elif preset == "Q3_K_L":
        t = "Q5_K"
    elif preset in ("IQ4_NL", "IQ4_XS") and n_gqa >= 4:
        t = "Q5_K"
    elif preset in ("Q4_K_M", "Q5_K_M") and more_bits(i, n):
        t = "Q6_K"
    elif preset == "Q4_K_S" and i < 4:
        t = "Q5_K"
    return "Q8_0" if n_expert == 8 else t


def _ffn_down(preset: str, t: str, i: int, n: int) -> str:
    if preset == "Q2_K":
        return "Q3_K"
    if preset == "Q3_K_M":
        return "Q5_K" if i < n // 16 else "Q4_K"
    if preset == "Q3_K_L":
        return "Q5_K"
    if preset == "Q4_K_M":
        return "Q6_K" if more_bits(i, n) else t
    if i < n // 8 and preset in ("IQ4_NL", "IQ4_XS"):
        return "Q5_K"
    if preset == "Q5_K_M" and more_bits(i, n):
        return "Q6_K"
    if preset == "Q4_K_S" and i < n // 8:
        return "Q5_K"
    return t


def _attn_output(preset: str, t: str, n_expert: int) -> str:
    if n_expert == 8:
        return "Q5_K" if preset in ("Q2_K", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ4_XS") else t
    return {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(preset, t)


def _fallback(t: str, ncols: int) -> str:
    if ncols % qtype(t).block_size == 0:
        return t
    if t not in FALLBACK:
        raise ValueError(f"llama-quantize has no fallback for {t} rows of {ncols}")
    t = FALLBACK[t]
    return t if ncols % qtype(t).block_size == 0 else "F16"


def tensor_type(preset: str, kind: str, layer: int, ncols: int, shape: Mapping, pure: bool = False) -> str:
    """The type of tensor `kind` (a GGUF name without blk.N., e.g. "attn_v", "ffn_down_exps",
    "token_embd") of `layer` (-1 if none), whose rows hold ncols weights, in a model of `shape`
    (tests.fixtures.SHAPES keys)."""
    if kind in UNQUANTIZED:
        return "F32"
    t = DEFAULT_TYPE[preset]
    n = shape["num_hidden_layers"]
    n_gqa = shape["num_attention_heads"] // shape["num_key_value_heads"]
    n_expert = shape["num_experts"]
    if pure or qtype(t).block_size == 1:     # the rules apply to quantized default types only
        pass
    elif kind == "output":
        t = "Q8_0" if ncols % qtype(t).block_size or t == "Q8_0" else "Q6_K"
    elif kind == "attn_v":
        t = _attn_v(preset, t, layer, n, n_gqa, n_expert)
    elif kind == "attn_k" and n_expert == 8:
        t = "Q8_0"
    elif kind == "ffn_down_exps":
        t = _ffn_down(preset, t, layer, n)
    elif kind == "attn_output":
        t = _attn_output(preset, t, n_expert)
    return _fallback(t, ncols)


def preset_qtypes(preset: str, shape: Mapping, pure: bool = False) -> dict:
    """`qtypes` for tests.fixtures.make_gguf: each tensor kind -> its type, or a list by layer."""
    from tests.fixtures import gguf_tensor_specs

    by_kind: dict = {}
    for _, kind, layer, tshape in gguf_tensor_specs(shape):
        t = tensor_type(preset, kind, layer, tshape[-1], shape, pure)
        if layer < 0:
            by_kind[kind] = t
        else:
            by_kind.setdefault(kind, []).append(t)
    return by_kind
