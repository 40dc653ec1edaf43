"""GGUF (qwen3moe, single file or llama.cpp splits) as a conversion Source; block bytes unchanged.

llama.cpp stores a layer's experts as 3-D tensors blk.l.ffn_{gate,up,down}_exps.weight of numpy shape
[E, I, D] / [E, D, I] with the expert outermost, so one expert's part is one contiguous byte range.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..config import ModelArgs
from ..errors import FormatError, InvalidArgument, UnsupportedError
from ..quant import QTYPES, tensor_bytes
from .checks import is_int, is_number, model_args_problem
from .gguf_file import GGUFFile, TensorInfo, check_extents, ggml_type_name, read_gguf
from .source import EXPERT_PARTS, NEXTN_OPTIONAL, ExpertSpec, Source, TensorSpec, dense_shapes, expert_shapes
from .tokenizer_build import gguf_tokenizer

ARCH = "qwen3moe"
_SPLIT = re.compile(r"^(?P<base>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_paths(path: Path) -> list[Path]:
    """All files of a split GGUF given any one of them (`name-00001-of-00003.gguf`); [path] otherwise."""
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    count = int(m.group("count"))
    paths = [path.with_name(f"{m.group('base')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise FormatError(f"{path}: split GGUF is missing {', '.join(missing)}")
    return paths


def _merge_splits(files: list[GGUFFile]) -> dict[str, tuple[GGUFFile, TensorInfo]]:
    first = files[0]
    count = first.kv.get("split.count")
    if count is not None and count != len(files):
        raise FormatError(f"{first.path}: split.count says {count!r:.80} files, found {len(files)}")
    tensors = {}
    for g in files:
        for name, info in g.tensors.items():
            if name in tensors:
                raise FormatError(f"{g.path}: tensor {name} also appears in {tensors[name][0].path.name}")
            tensors[name] = (g, info)
    expected = first.kv.get("split.tensors.count")
    if expected is not None and expected != len(tensors):
        raise FormatError(f"{first.path}: split.tensors.count says {expected!r:.80} tensors, "
                          f"the files hold {len(tensors)}")
    return tensors


_BLOCK = re.compile(r"^blk\.(\d+)\.")


class _Meta:
    """Typed access to `qwen3moe.*` keys with errors that name the file and key."""

    def __init__(self, g: GGUFFile, arch: str = ARCH):
        self.g, self.arch = g, arch

    def get(self, key: str, default=FormatError, kind=int):
        full = f"{self.arch}.{key}"
        if full not in self.g.kv:
            if default is FormatError:
                raise FormatError(f"{self.g.path}: missing metadata key {full}")
            return default
        v = self.g.kv[full]
        if isinstance(v, list):     # per-layer arrays (head counts): only uniform ones are supported
            if not v or not all(type(x) is type(v[0]) and not isinstance(x, list) for x in v):
                raise FormatError(f"{self.g.path}: metadata key {full} is an array of mixed or nested values")
            if len(set(v)) != 1:
                raise UnsupportedError(f"{self.g.path}: {full} varies across layers ({v[:8]}...)")
            v = v[0]
        return typed(self.g.path, full, v, kind)


def typed(path: Path, key: str, v, kind):
    """v as `kind` (int: an integer >= 0; float: a finite number; str; bool), or FormatError naming key."""
    ok = {int: is_int(v) and v >= 0, float: is_number(v), str: isinstance(v, str),
          bool: isinstance(v, bool) or is_int(v)}[kind]
    if not ok:
        what = {int: "an integer >= 0", float: "a finite number", str: "a string", bool: "a boolean"}[kind]
        raise FormatError(f"{path}: metadata key {key} = {v!r:.80} is not {what}")
    return kind(v)


def _rope_scaling(m: _Meta) -> dict | None:
    kind = m.get("rope.scaling.type", None, str)
    if kind in (None, "none"):
        return None
    rs = {"rope_type": kind, "factor": m.get("rope.scaling.factor", 1.0, float)}
    orig = m.get("rope.scaling.original_context_length", None)
    if orig:
        rs["original_max_position_embeddings"] = orig
    for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
        v = m.get(key, None, float)
        if v is not None:
            rs[name] = v
    return rs


def _block_count(g: GGUFFile, m: _Meta, tensors: dict) -> int:
    """block_count, checked against the blocks the tensors name before any per-layer work is sized by it."""
    block_count = m.get("block_count")
    blocks = {int(mt.group(1)) for name in tensors if (mt := _BLOCK.match(name))}
    if len(blocks) != block_count or max(blocks, default=-1) != block_count - 1:   # never range(block_count)
        extra = sorted(b for b in blocks if b >= block_count)[:3]
        missing = [b for b in range(min(block_count, len(blocks) + 1)) if b not in blocks][:3]
        raise FormatError(f"{g.path}: metadata key {m.arch}.block_count = {block_count}, but the tensors name "
                          f"{len(blocks)} blocks" + (f" (extra: {extra})" if extra else "")
                          + (f" (missing: {missing})" if missing else ""))
    return block_count


def _dims(g: GGUFFile, tensors: dict, name: str, ndim: int) -> tuple | None:
    """The shape of tensor `name` if present, after checking it has `ndim` dimensions."""
    if name not in tensors:
        return None
    shape = tensors[name][1].shape
    if len(shape) != ndim:
        raise FormatError(f"{tensors[name][0].path}: tensor {name} has shape {list(shape)}, "
                          f"expected {ndim} dimensions")
    return shape


def _model_args(g: GGUFFile, tensors: dict) -> ModelArgs:
    arch = g.kv.get("general.architecture")
    if arch != ARCH:
        raise UnsupportedError(f"{g.path}: architecture {str(arch)[:80]!r} is not supported "
                               f"(supported: {ARCH}, qwen3next)")
    m = _Meta(g)
    block_count, num_mtp = _block_count(g, m, tensors), m.get("nextn_predict_layers", 0)
    if num_mtp > 1:
        raise UnsupportedError(f"{g.path}: {num_mtp} MTP layers; Strata supports at most 1")
    num_layers = block_count
    if num_mtp and f"blk.{block_count - 1}.nextn.eh_proj.weight" in tensors:
        num_layers = block_count - 1    # llama.cpp counts the nextn layers in block_count
    embd = _dims(g, tensors, "token_embd.weight", 2)
    if embd is None:
        raise FormatError(f"{g.path}: missing tensor token_embd.weight")
    D, H = m.get("embedding_length"), m.get("attention.head_count")
    gate = _dims(g, tensors, "blk.0.ffn_gate_exps.weight", 3)
    q_norm = _dims(g, tensors, "blk.0.attn_q_norm.weight", 1)     # its length is the head dim when the key is absent
    try:
        args = ModelArgs(
            architecture=ARCH, vocab_size=embd[0], hidden_size=D,
            num_hidden_layers=num_layers, num_attention_heads=H,
            num_key_value_heads=m.get("attention.head_count_kv", H),
            head_dim=m.get("attention.key_length", q_norm[0] if q_norm else D // max(H, 1)),
            num_experts=m.get("expert_count"), num_experts_per_tok=m.get("expert_used_count"),
            moe_intermediate_size=m.get("expert_feed_forward_length", gate[1] if gate else FormatError),
            rms_norm_eps=m.get("attention.layer_norm_rms_epsilon", 1e-6, float),
            rope_theta=m.get("rope.freq_base", 10000.0, float), rope_scaling=_rope_scaling(m),
            norm_topk_prob=m.get("expert_weights_norm", True, bool),
            max_position_embeddings=m.get("context_length", 32768),
            tie_word_embeddings="output.weight" not in tensors, num_mtp_layers=num_mtp)
    except InvalidArgument as e:
        raise FormatError(f"{g.path}: inconsistent metadata: {e}") from None
    problem = model_args_problem(args)
    if problem:
        raise FormatError(f"{g.path}: unusable model numbers in the metadata: {problem}")
    return args


def _checked(g: GGUFFile, tensors: dict, name: str, shape: tuple) -> tuple[GGUFFile, TensorInfo]:
    part, info = tensors[name]
    if info.qtype is None:
        raise UnsupportedError(f"{part.path}: tensor {name} has quant type {ggml_type_name(info.ggml_type)}, "
                               f"which Strata does not support (supported: {', '.join(QTYPES)})")
    if info.shape != tuple(shape):
        raise FormatError(f"{part.path}: tensor {name} has shape {list(info.shape)}, "
                          f"the metadata implies {list(shape)}")
    try:
        tensor_bytes(info.qtype, info.shape)
    except UnsupportedError:
        raise FormatError(f"{part.path}: tensor {name}: rows of {shape[-1]} are not whole "
                          f"{info.qtype} blocks") from None
    check_extents(part, [name])
    return part, info


def _expert_spec(part: GGUFFile, info: TensorInfo, shape: tuple) -> ExpertSpec:
    per = tensor_bytes(info.qtype, shape)
    return ExpertSpec(info.qtype, shape, lambda e: part.tensor_bytes(info)[e * per:(e + 1) * per])


def open_gguf_source(path) -> Source:
    """The Source of a qwen3moe GGUF file (any split of a split GGUF names the whole set)."""
    path = Path(path)
    files = [read_gguf(p) for p in split_paths(path)]
    tensors = _merge_splits(files)
    args = _model_args(files[0], tensors)
    layers = range(args.num_hidden_layers + args.num_mtp_layers)
    shapes = dense_shapes(args)
    exp_shapes = expert_shapes(args)
    stacked = {"gate": (args.num_experts, *exp_shapes["gate"]), "up": (args.num_experts, *exp_shapes["up"]),
               "down": (args.num_experts, *exp_shapes["down"])}
    needed = list(shapes) + [f"blk.{l}.ffn_{p}_exps.weight" for l in layers for p in EXPERT_PARTS]
    missing = [n for n in needed if n not in tensors]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise FormatError(f"{files[0].path}: missing tensors {', '.join(missing[:5])}{more}")
    optional = f"blk.{args.num_hidden_layers}.{NEXTN_OPTIONAL}.weight"
    if args.num_mtp_layers and optional in tensors:
        shapes[optional] = (args.hidden_size,)
    dense = []
    for name, shape in shapes.items():
        part, info = _checked(files[0], tensors, name, shape)
        dense.append(TensorSpec(name, info.qtype, shape, lambda p=part, i=info: p.tensor_bytes(i)))
    experts = []
    for l in layers:
        specs = {}
        for p in EXPERT_PARTS:
            part, info = _checked(files[0], tensors, f"blk.{l}.ffn_{p}_exps.weight", stacked[p])
            specs[p] = _expert_spec(part, info, exp_shapes[p])
        experts.append(specs)
    tok_meta, tok_json = gguf_tokenizer(files[0].kv, files[0].path, args.vocab_size)
    src = Source("gguf", [f.path for f in files], args, dense, experts, tok_meta, tok_json)
    src._closers += [f.close for f in files]
    return src
