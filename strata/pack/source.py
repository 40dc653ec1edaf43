"""What a converter reads from: a model source as tensor specs that read their bytes on demand.

A GGUF file and a HF checkpoint both become a `Source`: ModelArgs, the dense tensors in pack order,
the expert parts of each layer, and the tokenizer. Every `read` returns flat uint8 block bytes, a
view into a memory map where possible, so a converter holds one tensor (or one expert) at a time.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..config import ModelArgs
from . import qwen3next_names

EXPERT_PARTS = ("gate", "up", "down")

# Per-layer dense tensors, in pack order (GGUF names inside "blk.{l}.").
LAYER_DENSE = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
               "ffn_norm", "ffn_gate_inp")
NEXTN_DENSE = ("nextn.eh_proj", "nextn.enorm", "nextn.hnorm")
# The MTP layer's own final norm (HF mtp.norm.weight), kept when the source has one: Qwen3-Next
# normalizes the draft layer's output with it before the shared output head.
NEXTN_OPTIONAL = "nextn.shared_head_norm"


@dataclass(frozen=True)
class TensorSpec:
    """One dense tensor: its pack name, quant type, numpy shape and a reader of its block bytes."""
    name: str
    qtype: str
    shape: tuple[int, ...]
    read: Callable[[], np.ndarray]


@dataclass(frozen=True)
class ExpertSpec:
    """One part (gate, up or down) of every expert of a layer; read(e) gives expert e's bytes."""
    qtype: str
    shape: tuple[int, ...]          # of one expert: [I, D] for gate/up, [D, I] for down
    read: Callable[[int], np.ndarray]


@dataclass
class Source:
    kind: str                                   # "gguf" or "hf"
    paths: list[Path]
    args: ModelArgs
    dense: list[TensorSpec]
    experts: list[dict[str, ExpertSpec]]        # one {"gate","up","down"} per layer (MTP layer last)
    tokenizer_meta: dict                        # the pack.json "tokenizer" entry, less "file"
    tokenizer_json: Callable[[], str]           # the HF tokenizers serialization
    notes: list[str] = field(default_factory=list)   # what the converter chose (type fallbacks)
    _closers: list[Callable[[], None]] = field(default_factory=list)

    def stat_entry(self) -> dict:
        """The pack.json "source" entry: what identifies this source's bytes on disk."""
        return source_stat(self.paths, self.kind)

    def close(self) -> None:
        for c in self._closers:
            c()
        self._closers.clear()


def source_stat(paths: list[Path], kind: str) -> dict:
    total, newest = 0, 0
    for p in paths:
        st = os.stat(p)
        total += st.st_size
        newest = max(newest, st.st_mtime_ns)
    return {"kind": kind, "paths": [str(Path(p).resolve()) for p in paths], "bytes": total, "mtime_ns": newest}


def dense_names(args: ModelArgs) -> list[str]:
    """Every dense tensor name of a model with these args, in pack order (output.weight if untied)."""
    names = ["token_embd.weight", "output_norm.weight"]
    if not args.tie_word_embeddings:
        names.append("output.weight")
    for layer in range(args.num_hidden_layers + args.num_mtp_layers):
        kinds = LAYER_DENSE + (NEXTN_DENSE if layer >= args.num_hidden_layers else ())
        names += [f"blk.{layer}.{k}.weight" for k in kinds]
    return names


def dense_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The numpy shape of every dense tensor the pack spec names."""
    if args.architecture == "qwen3next":
        return qwen3next_names.dense_shapes(args)
    D, V, E = args.hidden_size, args.vocab_size, args.num_experts
    q_rows, kv_rows = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    per_kind = {"attn_norm": (D,), "attn_q": (q_rows, D), "attn_k": (kv_rows, D), "attn_v": (kv_rows, D),
                "attn_output": (D, q_rows), "attn_q_norm": (args.head_dim,), "attn_k_norm": (args.head_dim,),
                "ffn_norm": (D,), "ffn_gate_inp": (E, D), "nextn.eh_proj": (D, 2 * D), "nextn.enorm": (D,),
                "nextn.hnorm": (D,)}
    out = {"token_embd.weight": (V, D), "output_norm.weight": (D,), "output.weight": (V, D)}
    for name in dense_names(args):
        if name.startswith("blk."):
            kind = name.split(".", 2)[2].rsplit(".", 1)[0]
            out[name] = per_kind[kind]
    return {n: out[n] for n in dense_names(args)}


def expert_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    D, I = args.hidden_size, args.moe_intermediate_size
    return {"gate": (I, D), "up": (I, D), "down": (D, I)}


@dataclass(frozen=True)
class FileSlice:
    """Bytes start..start + nbytes of a file, read where a whole file would be (memmap, and the
    expert store's pinning): a layer split's stage reads its own layers' part of experts.bin."""
    path: Path
    start: int
    nbytes: int

    @property
    def name(self) -> str:
        return f"{self.path.name}[{self.start}:{self.start + self.nbytes}]"

    def __str__(self) -> str:
        return f"{self.path} (bytes {self.start}..{self.start + self.nbytes})"


def memmap(path) -> np.ndarray:
    """A read-only uint8 memory map of a whole file (an empty array for an empty file), or of a
    FileSlice's bytes (as many of them as the file has: a short file stays short)."""
    if isinstance(path, FileSlice):
        whole = memmap(path.path)
        return whole[path.start:path.start + path.nbytes]
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")
