"""A Hugging Face Qwen3MoeForCausalLM checkpoint directory as a conversion Source.

Safetensors files are memory-mapped and parsed here (u64 header length, JSON header of dtype, shape
and data offsets, then the data), so BF16 needs no torch and nothing is loaded whole. Experts come
in either on-disk layout: per expert (`mlp.experts.{e}.gate_proj.weight`, what real Qwen3 checkpoints
and transformers 5's default save_pretrained write) or fused (`mlp.experts.gate_up_proj` [E, 2I, D],
`mlp.experts.down_proj` [E, D, I], transformers 5's in-memory layout, written with
save_original_format=False). With a qtype, matrices are quantized by strata.quant.quantize; norms
and the router stay F32.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import ModelArgs
from ..errors import FormatError, InvalidArgument, UnsupportedError
from ..quant import qtype as qtype_of
from .checks import model_args_problem, rope_scaling_problem
from .source import (EXPERT_PARTS, NEXTN_OPTIONAL, ExpertSpec, Source, TensorSpec, dense_shapes, expert_shapes,
                     memmap)
from .tokenizer_build import _read_json, hf_tokenizer

ARCHITECTURE = "Qwen3MoeForCausalLM"
_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
# HF names inside a decoder layer -> pack (GGUF) names inside blk.{l}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}


@dataclass(frozen=True)
class _Stored:
    path: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def _safetensors_index(path: Path) -> dict[str, _Stored]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise FormatError(f"{path}: not a safetensors file or truncated (header length {n}, {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise FormatError(f"{path}: malformed safetensors header ({e})") from None
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        start, end = (8 + n + int(o) for o in h["data_offsets"])
        if end > size:
            raise FormatError(f"{path}: truncated: tensor {name} ends at byte {end} but the file has {size} bytes")
        out[name] = _Stored(path, name, h["dtype"], tuple(int(d) for d in h["shape"]), start, end)
    return out


def safetensors_files(src: Path) -> list[Path]:
    """The weight files: those model.safetensors.index.json names, else every *.safetensors."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({src / f for f in _read_json(index).get("weight_map", {}).values()})
    else:
        files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FormatError(f"{src}: no *.safetensors files")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FormatError(f"{src}: missing {', '.join(missing)} (named by model.safetensors.index.json)")
    return files


def source_files(src: Path) -> list[Path]:
    """Every file a conversion of `src` reads (what identifies the checkpoint for the cache)."""
    extra = [src / n for n in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                               "chat_template.jinja") if (src / n).is_file()]
    return [src / "config.json", *safetensors_files(src), *extra]


class _Tensors:
    """Every tensor of the checkpoint by name, each read as raw bytes from its file's memory map."""

    def __init__(self, src: Path):
        self.files, self.entries, self.maps = safetensors_files(src), {}, {}
        for f in self.files:
            for name, st in _safetensors_index(f).items():
                if name in self.entries:
                    raise FormatError(f"{f}: tensor {name} also appears in {self.entries[name].path.name}")
                self.entries[name] = st

    def get(self, name: str, shape: tuple) -> _Stored:
        st = self.entries.get(name)
        if st is None:
            raise FormatError(f"{self.files[0].parent}: missing tensor {name}")
        if st.dtype not in _DTYPES:
            raise UnsupportedError(f"{st.path}: tensor {name} has dtype {st.dtype} (supported: F32, F16, BF16)")
        if st.shape != tuple(shape):
            raise FormatError(f"{st.path}: tensor {name} has shape {list(st.shape)}, config.json implies {list(shape)}")
        return st

    def raw(self, st: _Stored, lo: int = 0, hi: int | None = None) -> np.ndarray:
        if st.path not in self.maps:
            self.maps[st.path] = memmap(st.path)
        return self.maps[st.path][st.start + lo:st.start + (hi if hi is not None else st.end - st.start)]

    def close(self) -> None:
        self.maps.clear()


def to_float32(dtype: str, raw: np.ndarray, shape: tuple) -> np.ndarray:
    if dtype == "F32":
        return raw.view("<f4").reshape(shape)
    if dtype == "F16":
        return raw.view("<f2").astype(np.float32).reshape(shape)
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)


def _model_args(src: Path, cfg: dict) -> ModelArgs:
    archs = cfg.get("architectures") or []
    if ARCHITECTURE not in archs and cfg.get("model_type") != "qwen3_moe":
        raise UnsupportedError(f"{src}: architecture {', '.join(archs) or cfg.get('model_type')!r} is not "
                               f"supported (supported: {ARCHITECTURE}, Qwen3NextForCausalLM)")
    if cfg.get("mlp_only_layers"):
        raise UnsupportedError(f"{src}: dense MLP layers (mlp_only_layers={cfg['mlp_only_layers']}) are not supported")
    if int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise UnsupportedError(f"{src}: decoder_sparse_step={cfg['decoder_sparse_step']} is not supported (only 1)")
    if cfg.get("use_sliding_window"):
        raise UnsupportedError(f"{src}: sliding-window attention (use_sliding_window) is not supported")
    num_mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    if num_mtp > 1:
        raise UnsupportedError(f"{src}: {num_mtp} MTP layers; Strata supports at most 1")
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"}
                                          if rope.get("rope_type", "default") != "default" else None)
    if scaling and "rope_type" not in scaling and "type" in scaling:
        scaling = {"rope_type": scaling["type"], **{k: v for k, v in scaling.items() if k != "type"}}
    problem = rope_scaling_problem(scaling)
    if problem:
        raise FormatError(f"{src}/config.json: {problem}")
    try:
        D, H = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        args = ModelArgs(
            architecture="qwen3moe", vocab_size=int(cfg["vocab_size"]), hidden_size=D,
            num_hidden_layers=int(cfg["num_hidden_layers"]), num_attention_heads=H,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or H),
            head_dim=int(cfg.get("head_dim") or D // H),
            num_experts=int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0), rope_scaling=scaling,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), num_mtp_layers=num_mtp)
    except KeyError as e:
        raise FormatError(f"{src}/config.json: missing key {e.args[0]}") from None
    except InvalidArgument as e:
        raise FormatError(f"{src}/config.json: {e}") from None
    except (TypeError, ValueError, OverflowError, ZeroDivisionError) as e:     # int(None), int(inf), D // 0
        raise FormatError(f"{src}/config.json: a model number is not a number ({e})") from None
    problem = model_args_problem(args)
    if problem:
        raise FormatError(f"{src}/config.json: {problem}")
    return args


def hf_name(pack_name: str, num_layers: int) -> str:
    """The HF checkpoint name of a pack dense tensor (MTP layer: Qwen3-Next's mtp.* names)."""
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight", f"blk.{num_layers}.nextn.eh_proj.weight": "mtp.fc.weight",
             f"blk.{num_layers}.nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
             f"blk.{num_layers}.nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
             f"blk.{num_layers}.{NEXTN_OPTIONAL}.weight": "mtp.norm.weight"}
    if pack_name in fixed:
        return fixed[pack_name]
    _, layer, rest = pack_name.split(".", 2)
    hf_rest = {v: k for k, v in LAYER_NAMES.items()}[rest]
    return f"mtp.layers.0.{hf_rest}" if int(layer) == num_layers else f"model.layers.{layer}.{hf_rest}"


class _Plan:
    """Chooses each tensor's pack quant type and makes its reader."""

    def __init__(self, tensors: _Tensors, qtype: str | None, notes: list[str]):
        self.t, self.qtype, self.notes = tensors, qtype, notes

    def target(self, name: str, st_dtype: str, shape: tuple, keep_f32: bool) -> str:
        if self.qtype is None:
            return st_dtype
        if keep_f32 or len(shape) == 1:
            return "F32"
        if shape[-1] % qtype_of(self.qtype).block_size:
            self.notes.append(f"{name}: rows of {shape[-1]} are not whole {self.qtype} blocks, stored as F16")
            return "F16"
        return self.qtype

    def reader(self, st: _Stored, target: str, shape: tuple, lo: int = 0):
        """A function of no arguments giving the block bytes of st's bytes [lo, lo + nbytes)."""
        nbytes = math.prod(shape) * _DTYPES[st.dtype]
        if target == st.dtype:
            return lambda: self.t.raw(st, lo, lo + nbytes)
        return lambda: _quantize_rows(target, st.dtype, self.t.raw(st, lo, lo + nbytes), shape)


def _quantize_rows(target: str, dtype: str, raw: np.ndarray, shape: tuple, chunk_f32_bytes: int = 64 << 20):
    """Block bytes of a stored tensor in `target`, a slab of rows at a time so the float32
    temporaries stay small even for a [V, D] embedding."""
    from ..quant.quantize import quantize
    n = shape[-1]
    rows = math.prod(shape[:-1])
    step = max(1, chunk_f32_bytes // (4 * n))
    row_bytes = n * _DTYPES[dtype]
    parts = [quantize(target, to_float32(dtype, raw[r * row_bytes:min(r + step, rows) * row_bytes],
                                         (min(step, rows - r), n)))
             for r in range(0, rows, step)]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _expert_layer(plan: _Plan, prefix: str, args: ModelArgs, layer: int) -> dict[str, ExpertSpec]:
    shapes, E, I, D = expert_shapes(args), args.num_experts, args.moe_intermediate_size, args.hidden_size
    t = plan.t
    if f"{prefix}.gate_up_proj" in t.entries:
        fused = {"gate": t.get(f"{prefix}.gate_up_proj", (E, 2 * I, D)),
                 "down": t.get(f"{prefix}.down_proj", (E, D, I))}
        fused["up"] = fused["gate"]
        size = {p: _DTYPES[fused[p].dtype] for p in fused}
        stride = {"gate": 2 * I * D * size["gate"], "up": 2 * I * D * size["gate"], "down": D * I * size["down"]}
        first = {"gate": 0, "up": I * D * size["gate"], "down": 0}
        out = {}
        for p in EXPERT_PARTS:
            st, target = fused[p], plan.target(f"blk.{layer}.ffn_{p}_exps", fused[p].dtype, shapes[p], False)
            readers = [plan.reader(st, target, shapes[p], first[p] + e * stride[p]) for e in range(E)]
            out[p] = ExpertSpec(target, shapes[p], lambda e, r=readers: r[e]())
        return out
    out = {}
    for p in EXPERT_PARTS:
        sts = [t.get(f"{prefix}.{e}.{p}_proj.weight", shapes[p]) for e in range(E)]
        if len({st.dtype for st in sts}) != 1:
            raise UnsupportedError(f"{sts[0].path}: experts of {prefix} mix dtypes")
        target = plan.target(f"blk.{layer}.ffn_{p}_exps", sts[0].dtype, shapes[p], False)
        readers = [plan.reader(st, target, shapes[p]) for st in sts]
        out[p] = ExpertSpec(target, shapes[p], lambda e, r=readers: r[e]())
    return out


def open_hf_source(src, qtype: str | None = None) -> Source:
    """The Source of a HF Qwen3MoeForCausalLM checkpoint directory (config.json + *.safetensors)."""
    src = Path(src)
    cfg = _read_json(src / "config.json", required=True)
    args = _model_args(src, cfg)
    tensors, notes = _Tensors(src), []
    plan = _Plan(tensors, qtype, notes)
    shapes = dense_shapes(args)
    if args.num_mtp_layers and "mtp.norm.weight" in tensors.entries:
        shapes[f"blk.{args.num_hidden_layers}.{NEXTN_OPTIONAL}.weight"] = (args.hidden_size,)
    dense = []
    for name, shape in shapes.items():
        st = tensors.get(hf_name(name, args.num_hidden_layers), shape)
        target = plan.target(name, st.dtype, shape, keep_f32=name.endswith("ffn_gate_inp.weight"))
        dense.append(TensorSpec(name, target, shape, plan.reader(st, target, shape)))
    L = args.num_hidden_layers
    experts = [_expert_layer(plan, f"model.layers.{l}.mlp.experts" if l < L else "mtp.layers.0.mlp.experts", args, l)
               for l in range(L + args.num_mtp_layers)]
    tok_meta, tok_json = hf_tokenizer(src, cfg)
    source = Source("hf", source_files(src), args, dense, experts, tok_meta, tok_json, notes)
    source._closers.append(tensors.close)
    return source
