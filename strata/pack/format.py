"""Pack format v1: the layout rules and the reader (memory maps, checksums).

A pack directory holds pack.json, dense.bin (every non-expert tensor at a 256-byte-aligned offset),
experts.bin (blob (l, e) = gate | up | down rows of one expert at layers[l].offset + e * stride, each
blob 4096-aligned so one DMA moves one expert) and tokenizer.json. docs/DESIGN.md has the
whole format.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from ..config import ModelArgs
from ..errors import InvalidArgument, PackError
from ..quant import QTensor, tensor_bytes
from .source import EXPERT_PARTS, ExpertSpec, TensorSpec, memmap
from .validate import BLOB_ALIGN, DATA_FILES, DENSE_ALIGN, check_meta, round_up  # noqa: F401 (part of the format)

FORMAT = "strata-pack"
VERSION = 1
STAMP = ".verified.json"


def layout(dense: list[TensorSpec], experts: list[dict[str, ExpertSpec]], num_experts: int) -> dict:
    """The "dense", "experts" and "max_blob" entries of pack.json, plus the two data file sizes."""
    table, off = {}, 0
    for t in dense:
        off = round_up(off, DENSE_ALIGN)
        nbytes = tensor_bytes(t.qtype, t.shape)
        table[t.name] = {"qtype": t.qtype, "shape": list(t.shape), "offset": off, "nbytes": nbytes}
        off += nbytes
    dense_bytes, layers, off = off, [], 0
    for layer, parts in enumerate(experts):
        entry, blob = {}, 0
        for p in EXPERT_PARTS:
            nbytes = tensor_bytes(parts[p].qtype, parts[p].shape)
            entry[p] = {"qtype": parts[p].qtype, "shape": list(parts[p].shape), "offset": blob, "nbytes": nbytes}
            blob += nbytes
        off = round_up(off, BLOB_ALIGN)
        stride = round_up(blob, BLOB_ALIGN)
        layers.append({"layer": layer, "offset": off, "stride": stride, "blob_bytes": blob, "parts": entry})
        off += num_experts * stride
    return {"dense": table, "experts": {"layers": layers},
            "max_blob": max((l["blob_bytes"] for l in layers), default=0),
            "_sizes": {"dense.bin": dense_bytes, "experts.bin": off}}


def is_pack_dir(path) -> bool:
    """True when `path` is a directory whose pack.json says it is a Strata pack (any version)."""
    try:
        meta = json.loads((Path(path) / "pack.json").read_text(encoding="utf-8"))
        return isinstance(meta, dict) and meta.get("format") == FORMAT
    except (OSError, ValueError):
        return False


def file_sha256(path: Path, chunk_bytes: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def read_meta(path: Path) -> dict:
    """pack.json of a pack directory, checked for format and version, then in full (validate.py)."""
    meta_path = path / "pack.json"
    if not path.is_dir():
        raise PackError(f"{path}: not a directory")
    if not meta_path.is_file():
        raise PackError(f"{path}: missing pack.json (not a pack, or an interrupted conversion)")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise PackError(f"{meta_path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise PackError(f"{meta_path}: not a Strata pack (format {found!r})")
    if meta.get("version") != VERSION:
        raise PackError(f"{meta_path}: pack format version {meta.get('version')!r}, this Strata reads version "
                        f"{VERSION}; convert the model again")
    for key in ("model_args", "tokenizer", "dense", "experts", "max_blob", "files"):
        if key not in meta:
            raise PackError(f"{meta_path}: missing key {key!r}")
    check_meta(meta_path, meta)
    return meta


def verify_files(path: Path, files: dict, verify: bool) -> None:
    """Sizes always; sha256 when verify, trusting a .verified.json stamp while size and mtime hold."""
    stamp_path = path / STAMP
    try:
        stamp = json.loads(stamp_path.read_text()) if verify else {}
        stamp_mtime = stamp_path.stat().st_mtime_ns if verify else 0
    except (OSError, ValueError):
        stamp, stamp_mtime = {}, 0
    fresh, hashed = {}, False
    for name, entry in files.items():
        f = path / name
        try:
            st = f.stat()
        except FileNotFoundError:
            raise PackError(f"{f}: missing") from None
        if st.st_size != entry["bytes"]:
            raise PackError(f"{f}: {st.st_size} bytes, pack.json says {entry['bytes']} (truncated or replaced)")
        if not verify:
            continue
        known = stamp.get(name)
        # A stamp entry is trusted only if the file was last written before the stamp (git's "racy"
        # rule): a write in the same clock tick as the stamp could otherwise keep the same mtime.
        if known == [st.st_size, st.st_mtime_ns, entry["sha256"]] and st.st_mtime_ns < stamp_mtime:
            fresh[name] = known
            continue
        hashed = True
        if file_sha256(f) != entry["sha256"]:
            raise PackError(f"{f}: sha256 mismatch (the file is corrupted)")
        fresh[name] = [st.st_size, st.st_mtime_ns, entry["sha256"]]
    if hashed:
        write_stamp(path, fresh)


def write_stamp(path: Path, entries: dict) -> None:
    try:
        tmp = path / f"{STAMP}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, path / STAMP)
    except OSError:
        pass    # a read-only pack is verified again next time


class Pack:
    """An open pack: metadata, and zero-copy views of its tensors in two read-only memory maps."""

    def __init__(self, path: Path, meta: dict):
        self.path = path
        self.meta = meta
        try:
            self.args = ModelArgs.from_dict(meta["model_args"])
        except (TypeError, InvalidArgument) as e:
            raise PackError(f"{path / 'pack.json'}: bad model_args ({e})") from None
        self.max_blob = int(meta["max_blob"])
        self.tokenizer_meta = meta["tokenizer"]
        self.tokenizer_path = path / meta["tokenizer"].get("file", "tokenizer.json")
        self._layers = meta["experts"]["layers"]
        self._dense_map = memmap(path / "dense.bin")
        self._experts_map = memmap(path / "experts.bin")

    def dense_names(self) -> list[str]:
        return list(self.meta["dense"])

    def has_dense(self, name: str) -> bool:
        return name in self.meta["dense"]

    def dense(self, name: str) -> QTensor:
        t = self.meta["dense"].get(name)
        if t is None:
            raise PackError(f"{self.path}: no dense tensor {name!r}")
        return QTensor(t["qtype"], tuple(t["shape"]), self._dense_map[t["offset"]:t["offset"] + t["nbytes"]])

    def expert_layout(self, layer: int) -> dict:
        if not 0 <= layer < len(self._layers):
            raise InvalidArgument(f"{self.path}: expert layer {layer} out of range 0..{len(self._layers) - 1}")
        return self._layers[layer]

    def expert_blob(self, layer: int, e: int) -> np.ndarray:
        lay = self.expert_layout(layer)
        if not 0 <= e < self.args.num_experts:
            raise InvalidArgument(f"{self.path}: expert {e} out of range 0..{self.args.num_experts - 1}")
        start = lay["offset"] + e * lay["stride"]
        return self._experts_map[start:start + lay["blob_bytes"]]

    def expert(self, layer: int, e: int) -> dict[str, QTensor]:
        blob = self.expert_blob(layer, e)
        parts = self.expert_layout(layer)["parts"]
        return {p: QTensor(v["qtype"], tuple(v["shape"]), blob[v["offset"]:v["offset"] + v["nbytes"]])
                for p, v in parts.items()}

    def close(self) -> None:
        self._dense_map = self._experts_map = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_pack(path, verify: bool = True) -> Pack:
    """Open a pack directory. PackError: missing file, bad JSON, other version, wrong size, bad sha256."""
    path = Path(path)
    meta = read_meta(path)
    missing = [n for n in DATA_FILES if n not in meta["files"]]
    if missing:
        raise PackError(f"{path / 'pack.json'}: no entry for {', '.join(missing)} in 'files'")
    verify_files(path, meta["files"], verify)
    return Pack(path, meta)
