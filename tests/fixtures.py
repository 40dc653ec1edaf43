"""Tiny qwen3moe models for tests: shapes, a tokenizer, HF checkpoints, GGUF files and packs.

Everything here is deterministic in `seed` and small enough to build in well under a second.

- `SHAPES`: tiny model shapes, each a dict of HF `Qwen3MoeConfig` keyword arguments.
- `make_tokenizer()`: a byte-level BPE (`tokenizers.Tokenizer`) with Qwen's special tokens;
  `CHAT_TEMPLATE` is a ChatML jinja template for it.
- `make_hf_dir()`: a random `Qwen3MoeForCausalLM` saved as a HF checkpoint directory.
- `make_gguf()`: a qwen3moe GGUF (optionally split) with random valid block bytes per quant type,
  plus the `Qwen3MoeForCausalLM` holding exactly the dequantized weights (the oracle).
- `make_pack()`: a HF checkpoint converted to a Strata pack.

Import as `from tests.fixtures import SHAPES, make_gguf` (tests run from the repo root).
"""
from __future__ import annotations

import functools
import inspect
import json
import math
from pathlib import Path
from typing import Mapping

import numpy as np

# Common to every shape: Qwen3-MoE's real settings where they matter to the math.
_COMMON = dict(
    rms_norm_eps=1e-6, rope_theta=1e6, norm_topk_prob=True, max_position_embeddings=4096,
    tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False,
    hidden_act="silu", initializer_range=0.05,
)

SHAPES: dict[str, dict] = {
    # The smallest useful model: 2 layers, 4 experts top-2.
    "tiny": dict(_COMMON, vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32),
    # Awkward sizes: H*Dh != D would be legal too, here 4*24 = 96; 6 experts top-3; 3 layers.
    "odd": dict(_COMMON, vocab_size=300, hidden_size=96, intermediate_size=64, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=6,
                num_experts_per_tok=3, moe_intermediate_size=64),
    # Rows of 256 everywhere (D, I, H*Dh), so K-quants (Q4_K, Q6_K, IQ4_XS...) fit every matrix.
    "kquant": dict(_COMMON, vocab_size=300, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=256),
    # "tiny" plus one MTP draft layer (Qwen3-Next tensor names mtp.* in HF, blk.L.* and blk.L.nextn.*
    # in GGUF, including the draft layer's own output norm mtp.norm / nextn.shared_head_norm).
    "mtp": dict(_COMMON, vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32, num_nextn_predict_layers=1),
}

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML, as Qwen models use it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The Qwen2 pre-tokenizer split (llama.cpp calls it "qwen2").
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def load_tool(name: str):
    """tools/<name>.py as a module, loaded by path (tools/ is not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------
# Tokenizer

def _training_text() -> list[str]:
    """Docstrings of a few stdlib modules: text already on every machine, fixed for a Python version."""
    import collections, functools, json as json_mod, string, textwrap  # noqa: E401
    out = []
    for mod in (textwrap, string, json_mod, collections, functools):
        out.append(inspect.getdoc(mod) or "")
        for name in sorted(dir(mod)):
            doc = inspect.getdoc(getattr(mod, name, None))
            if doc:
                out.append(doc)
    return out


def make_tokenizer(vocab_size: int = 300):
    """A byte-level BPE of `vocab_size` tokens, Qwen-style: the Qwen2 split regex, NFC, and the
    special tokens <|endoftext|>, <|im_start|>, <|im_end|> as the last three ids. A fresh object
    each call (training runs once per vocab size)."""
    from tokenizers import Tokenizer
    return Tokenizer.from_str(_trained_tokenizer_json(vocab_size))


@functools.cache
def _trained_tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(_training_text(), trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if tok.get_vocab_size() != vocab_size:
        raise AssertionError(f"make_tokenizer: got {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok.to_str()


def _tokenizer_files(path: Path, tok) -> None:
    tok.save(str(path / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    cfg = {
        "tokenizer_class": "Qwen2Tokenizer", "model_max_length": 4096, "chat_template": CHAT_TEMPLATE,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False,
        "added_tokens_decoder": {str(i): {"content": t, "special": True} for t, i in ids.items()},
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


# ---------------------------------------------------------------------------------------------
# HF checkpoints

def hf_config(shape: Mapping):
    """The transformers Qwen3MoeConfig of a shape (unknown keys such as num_nextn_predict_layers kept)."""
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(**dict(shape))


def _init_weights(model, seed: int) -> None:
    """Weights large enough that logits are not flat and routing is not uniform."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


# The HF -> pack name map, kept apart from strata.pack.hf_source.LAYER_NAMES on purpose: the oracle
# model is built from this one, so a wrong map in the converter cannot agree with itself.
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}


def _mtp_tensors(shape: Mapping, seed: int) -> dict[str, np.ndarray]:
    """Random float32 MTP draft-layer tensors under their Qwen3-Next HF names."""
    rng = np.random.default_rng(seed + 7919)
    D, E, I = shape["hidden_size"], shape["num_experts"], shape["moe_intermediate_size"]
    H, Hk, Dh = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    mats = {"self_attn.q_proj.weight": (H * Dh, D), "self_attn.k_proj.weight": (Hk * Dh, D),
            "self_attn.v_proj.weight": (Hk * Dh, D), "self_attn.o_proj.weight": (D, H * Dh),
            "mlp.gate.weight": (E, D)}
    mats.update({f"mlp.experts.{e}.{p}_proj.weight": (I, D) for e in range(E) for p in ("gate", "up")})
    mats.update({f"mlp.experts.{e}.down_proj.weight": (D, I) for e in range(E)})
    norms = {"input_layernorm.weight": D, "post_attention_layernorm.weight": D,
             "self_attn.q_norm.weight": Dh, "self_attn.k_norm.weight": Dh}
    out = {f"mtp.layers.0.{k}": 0.05 * rng.standard_normal(s) for k, s in mats.items()}
    out.update({f"mtp.layers.0.{k}": 1 + 0.1 * rng.standard_normal(n) for k, n in norms.items()})
    out["mtp.fc.weight"] = 0.05 * rng.standard_normal((D, 2 * D))
    out["mtp.pre_fc_norm_embedding.weight"] = 1 + 0.1 * rng.standard_normal(D)
    out["mtp.pre_fc_norm_hidden.weight"] = 1 + 0.1 * rng.standard_normal(D)
    out["mtp.norm.weight"] = 1 + 0.1 * rng.standard_normal(D)
    return {k: v.astype(np.float32) for k, v in out.items()}


def make_hf_dir(tmp_path, shape: Mapping, seed: int = 0, dtype=None, fused: bool = False,
                name: str = "hf"):
    """A random Qwen3MoeForCausalLM saved under tmp_path/name as a HF checkpoint.

    Writes model.safetensors (save_pretrained; per-expert tensors `mlp.experts.{e}.gate_proj.weight`
    unless fused=True, which writes transformers 5's fused `mlp.experts.gate_up_proj` [E, 2I, D] and
    `mlp.experts.down_proj` [E, D, I]), config.json, generation_config.json (eos = [im_end,
    endoftext]), tokenizer.json and tokenizer_config.json (ChatML template, eos <|im_end|>).
    When the shape has num_nextn_predict_layers=1, random MTP tensors go to model-mtp.safetensors.

    dtype (torch dtype, default float32) is what is stored; the returned model is float32 in eval
    mode and holds exactly the stored (rounded) weights. Returns (path, model).
    """
    import torch
    from transformers import Qwen3MoeForCausalLM
    dtype = dtype or torch.float32
    path = Path(tmp_path) / name
    tok = make_tokenizer(shape["vocab_size"])
    cfg = hf_config(shape)
    cfg.eos_token_id = tok.token_to_id("<|im_end|>")
    cfg.bos_token_id = tok.token_to_id("<|endoftext|>")
    model = Qwen3MoeForCausalLM(cfg)
    _init_weights(model, seed)
    gen_eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    model.generation_config.eos_token_id = gen_eos
    model.generation_config.bos_token_id = cfg.bos_token_id
    model.to(dtype).save_pretrained(path, save_original_format=not fused)
    if shape.get("num_nextn_predict_layers"):
        from safetensors.torch import save_file
        mtp = {k: torch.from_numpy(v).to(dtype) for k, v in _mtp_tensors(shape, seed).items()}
        save_file(mtp, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
    _tokenizer_files(path, tok)
    return path, model.float().eval()


# ---------------------------------------------------------------------------------------------
# GGUF files

DEFAULT_QTYPES = {"embd": "Q8_0", "output": "Q8_0", "attn": "Q8_0", "experts": "Q8_0",
                  "norm": "F32", "router": "F32", "nextn": "Q8_0"}

# tensor kind (GGUF name inside a block) -> the group key of `qtypes`
_KIND_GROUP = {"attn_q": "attn", "attn_k": "attn", "attn_v": "attn", "attn_output": "attn",
               "ffn_gate_exps": "experts", "ffn_up_exps": "experts", "ffn_down_exps": "experts",
               "attn_norm": "norm", "ffn_norm": "norm", "attn_q_norm": "norm", "attn_k_norm": "norm",
               "ffn_gate_inp": "router", "nextn.eh_proj": "nextn", "nextn.enorm": "norm",
               "nextn.hnorm": "norm", "nextn.shared_head_norm": "norm", "token_embd": "embd", "output": "output",
               "output_norm": "norm"}


def pick_qtype(qtypes: Mapping, kind: str, layer: int = 0) -> str:
    """The quant type of tensor `kind` (e.g. "attn_q", "ffn_down_exps", "token_embd") in `layer`.

    `qtypes` maps a kind or its group ("attn", "experts", "norm", "router", "embd", "output",
    "nextn") to a type name, or to a list of names indexed by layer (cycled) to vary types across
    layers; a kind's own key wins over its group's; unspecified groups use DEFAULT_QTYPES.
    """
    group = _KIND_GROUP[kind]
    v = qtypes.get(kind, qtypes.get(group, DEFAULT_QTYPES[group]))
    if isinstance(v, (list, tuple)):
        v = v[layer % len(v)]
    return str(v).upper()


def gguf_tensor_specs(shape: Mapping) -> list[tuple[str, str, int, tuple[int, ...]]]:
    """(GGUF name, kind, layer, numpy shape) of every tensor of a qwen3moe GGUF of this shape, in
    llama.cpp's order. An MTP draft layer is blk.L (L = num_hidden_layers); layer -1 = not per-layer."""
    D, V, E, I = shape["hidden_size"], shape["vocab_size"], shape["num_experts"], shape["moe_intermediate_size"]
    H, Hk, Dh = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    L = shape["num_hidden_layers"]
    specs = [("token_embd.weight", "token_embd", -1, (V, D)), ("output_norm.weight", "output_norm", -1, (D,))]
    if not shape.get("tie_word_embeddings"):
        specs.append(("output.weight", "output", -1, (V, D)))
    per_layer = [("attn_norm", (D,)), ("attn_q", (H * Dh, D)), ("attn_k", (Hk * Dh, D)), ("attn_v", (Hk * Dh, D)),
                 ("attn_output", (D, H * Dh)), ("attn_q_norm", (Dh,)), ("attn_k_norm", (Dh,)), ("ffn_norm", (D,)),
                 ("ffn_gate_inp", (E, D)), ("ffn_gate_exps", (E, I, D)), ("ffn_up_exps", (E, I, D)),
                 ("ffn_down_exps", (E, D, I))]
    nextn = [("nextn.eh_proj", (D, 2 * D)), ("nextn.enorm", (D,)), ("nextn.hnorm", (D,)),
             ("nextn.shared_head_norm", (D,))]
    for layer in range(L + int(shape.get("num_nextn_predict_layers", 0) or 0)):
        for kind, s in per_layer + (nextn if layer >= L else []):
            specs.append((f"blk.{layer}.{kind}.weight", kind, layer, s))
    return specs


def random_tensor_bytes(qtype_name: str, shape: tuple[int, ...], rng: np.random.Generator,
                        kind: str = "") -> np.ndarray:
    """Random valid block bytes (flat uint8) of a tensor of GGUF kind `kind` ("attn_norm", "ffn_gate_inp",
    ...): norms near 1 (float types only), the router spread so routing is not uniform, matrices small."""
    from strata.quant.random import random_qtensor_bytes
    if kind.endswith("norm"):
        values = (1.0 + 0.1 * rng.standard_normal(math.prod(shape))).astype(np.float32)
        if qtype_name == "F32":
            return values.view(np.uint8)
        if qtype_name == "F16":
            return values.astype(np.float16).view(np.uint8)
        if qtype_name == "BF16":
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        raise ValueError(f"random_tensor_bytes: norms must be F32, F16 or BF16, not {qtype_name}")
    std = {"ffn_gate_inp": 0.2, "token_embd": 0.1, "output": 0.1}.get(kind, 0.05)
    return random_qtensor_bytes(qtype_name, shape, rng, std=std)


def dequantize_bytes(qtype_name: str, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of a tensor's block bytes, by gguf.quants (the independent oracle)."""
    from gguf import GGMLQuantizationType, quants
    from strata.quant import qtype
    rows = np.asarray(data, dtype=np.uint8).reshape(*shape[:-1], qtype(qtype_name).row_bytes(shape[-1]))
    return quants.dequantize(rows, GGMLQuantizationType[qtype_name]).astype(np.float32).reshape(shape)


def _gguf_metadata(w, shape: Mapping, tok, name: str) -> None:
    from gguf import TokenType
    arch = "qwen3moe"
    L = shape["num_hidden_layers"]
    mtp = int(shape.get("num_nextn_predict_layers", 0) or 0)
    w.add_name(name)
    w.add_uint32(f"{arch}.block_count", L + mtp)   # llama.cpp counts nextn layers as blocks
    w.add_uint32(f"{arch}.context_length", shape["max_position_embeddings"])
    w.add_uint32(f"{arch}.embedding_length", shape["hidden_size"])
    w.add_uint32(f"{arch}.feed_forward_length", shape["intermediate_size"])
    w.add_uint32(f"{arch}.attention.head_count", shape["num_attention_heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", shape["num_key_value_heads"])
    w.add_uint32(f"{arch}.attention.key_length", shape["head_dim"])
    w.add_uint32(f"{arch}.attention.value_length", shape["head_dim"])
    w.add_float32(f"{arch}.rope.freq_base", shape["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", shape["rms_norm_eps"])
    w.add_uint32(f"{arch}.expert_count", shape["num_experts"])
    w.add_uint32(f"{arch}.expert_used_count", shape["num_experts_per_tok"])
    w.add_uint32(f"{arch}.expert_feed_forward_length", shape["moe_intermediate_size"])
    if mtp:
        w.add_uint32(f"{arch}.nextn_predict_layers", mtp)
    w.add_quantization_version(2)
    vocab = {i: t for t, i in tok.get_vocab().items()}
    specials = {tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tokens = [vocab.get(i, f"[PAD{i}]") for i in range(shape["vocab_size"])]
    types = [TokenType.CONTROL if i in specials else TokenType.UNUSED if i not in vocab else TokenType.NORMAL
             for i in range(shape["vocab_size"])]
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen2")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [int(t) for t in types])
    w.add_array("tokenizer.ggml.merges", [m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_uint32("tokenizer.ggml.eos_token_id", tok.token_to_id("<|im_end|>"))
    w.add_uint32("tokenizer.ggml.padding_token_id", tok.token_to_id("<|endoftext|>"))
    w.add_uint32("tokenizer.ggml.bos_token_id", tok.token_to_id("<|endoftext|>"))
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", CHAT_TEMPLATE)


def _hf_state_from_gguf(shape: Mapping, values: Mapping[str, np.ndarray]) -> dict:
    """transformers' in-memory state dict (fused experts) of dequantized GGUF tensors (main layers)."""
    import torch
    L = shape["num_hidden_layers"]
    back = {}
    for layer in range(L):
        for hf, gg in _LAYER_NAMES.items():
            back[f"blk.{layer}.{gg}"] = f"model.layers.{layer}.{hf}"
    back.update({"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"})
    state = {back[k]: torch.from_numpy(v) for k, v in values.items() if k in back}
    if shape.get("tie_word_embeddings"):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    for layer in range(L):
        g, u, d = (values[f"blk.{layer}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
        state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.from_numpy(np.concatenate([g, u], axis=1))
        state[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.from_numpy(d)
    return state


def make_gguf(tmp_path, shape: Mapping, qtypes: Mapping | None = None, seed: int = 0, split: int = 1,
              name: str = "model", metadata: Mapping | None = None):
    """A qwen3moe GGUF under tmp_path with random valid block bytes; returns (paths, hf_model).

    qtypes: see `pick_qtype`, e.g. {"attn": "Q8_0", "experts": ["Q4_K", "Q6_K"], "embd": "Q6_K"}
    (a list varies the type across layers). Tokenizer metadata comes from make_tokenizer (gpt2 model,
    "qwen2" pre-tokenizer, ChatML template, eos <|im_end|>, bos/pad <|endoftext|>, add_bos false).
    split > 1 writes llama.cpp-style splits `name-0000k-of-0000n.gguf` (metadata in the first,
    split.no/split.count/split.tensors.count in each); paths lists them in order.
    metadata: extra GGUF keys (int -> u32, float -> f32, str, bool), e.g. rope scaling keys.
    hf_model is a float32 Qwen3MoeForCausalLM (eval mode) holding exactly the gguf.quants-dequantized
    weights (the MTP layer, if any, is only in the GGUF).
    """
    import gguf
    import torch
    from transformers import Qwen3MoeForCausalLM
    from strata.quant import qtype as qtype_of
    qtypes = dict(qtypes or {})
    rng = np.random.default_rng(seed)
    specs = gguf_tensor_specs(shape)
    per_split = math.ceil(len(specs) / split) if split > 1 else 0
    path = Path(tmp_path) / f"{name}.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(path, "qwen3moe", split_max_tensors=per_split)
    _gguf_metadata(w, shape, make_tokenizer(shape["vocab_size"]), name)
    for key, value in (metadata or {}).items():
        adder = {bool: w.add_bool, int: w.add_uint32, float: w.add_float32, str: w.add_string}[type(value)]
        adder(key, value)
    values = {}
    for tname, kind, layer, tshape in specs:
        qname = pick_qtype(qtypes, kind, max(layer, 0))
        data = random_tensor_bytes(qname, tshape, rng, kind)
        rows = data.reshape(*tshape[:-1], qtype_of(qname).row_bytes(tshape[-1]))
        w.add_tensor(tname, rows, raw_dtype=gguf.GGMLQuantizationType[qname])
        values[tname] = dequantize_bytes(qname, data, tshape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    paths = w.format_shard_names(path)
    model = Qwen3MoeForCausalLM(hf_config(shape))
    model.load_state_dict(_hf_state_from_gguf(shape, values), strict=True)
    return [Path(p) for p in paths], model.float().eval()


# ---------------------------------------------------------------------------------------------
# Packs

def make_pack(tmp_path, shape: Mapping, seed: int = 0, qtype: str | None = None, dtype=None,
              fused: bool = False, name: str = "pack"):
    """make_hf_dir + strata.pack.convert (qtype None keeps the stored dtype). Returns (pack_path, hf_model)."""
    from strata.pack import convert
    hf, model = make_hf_dir(tmp_path, shape, seed=seed, dtype=dtype, fused=fused, name=name + "-hf")
    return convert(hf, Path(tmp_path) / name, qtype=qtype, progress=False), model


def make_gguf_pack(tmp_path, shape: Mapping, qtypes: Mapping | None = None, seed: int = 0,
                   name: str = "pack"):
    """make_gguf + strata.pack.convert. Returns (pack_path, hf_model)."""
    from strata.pack import convert
    paths, model = make_gguf(tmp_path, shape, qtypes, seed=seed, name=name + "-src")
    return convert(paths[0], Path(tmp_path) / name, progress=False), model


__all__ = ["SHAPES", "CHAT_TEMPLATE", "SPECIAL_TOKENS", "DEFAULT_QTYPES", "make_tokenizer", "make_hf_dir",
           "make_gguf", "make_pack", "make_gguf_pack", "pick_qtype", "gguf_tensor_specs", "hf_config",
           "random_tensor_bytes", "dequantize_bytes"]
