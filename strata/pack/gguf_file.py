"""A GGUF parser that turns every malformed file into one FormatError naming the file.

GGUF (v2, v3; little-endian): magic b"GGUF", u32 version, u64 tensor count, u64 key-value count,
the key-value pairs, the tensor infos (name, dims ne0 first, ggml type, offset into the data
section), then the data section at the next multiple of `general.alignment` (default 32).
Tensor bytes stay in a read-only memory map; nothing is copied.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import FormatError, UnsupportedError
from ..quant import QTYPES_BY_ID, tensor_bytes
from .source import memmap

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# value type id -> struct format of a scalar (8 = string, 9 = array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
          11: "<i8", 12: "<f8"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]      # numpy order: reversed ne
    offset: int                 # absolute byte offset in the file

    @property
    def qtype(self) -> str | None:
        qt = QTYPES_BY_ID.get(self.ggml_type)
        return qt.name if qt else None

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.qtype, self.shape)


@dataclass
class GGUFFile:
    path: Path
    version: int
    kv: dict
    tensors: dict[str, TensorInfo]
    size: int
    data: np.ndarray | None = None      # the uint8 memory map, after map()

    def map(self) -> np.ndarray:
        if self.data is None:
            self.data = memmap(self.path)
        return self.data

    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        return self.map()[info.offset:info.offset + info.nbytes]

    def close(self) -> None:
        self.data = None


def ggml_type_name(type_id: int) -> str:
    try:
        import gguf
        return gguf.GGMLQuantizationType(type_id).name
    except (ImportError, ValueError):
        return f"ggml type {type_id}"


MAX_DIMS = 4                # ggml's GGML_MAX_DIMS
MAX_NESTING = 3             # arrays of arrays: Strata reads none, llama.cpp writes none this deep
MAX_KEY_BYTES = 65535       # the GGUF spec's bound on a key


class _Cursor:
    """Reads little-endian fields; every length and count is bounded by the bytes left first."""

    def __init__(self, buf: bytes | memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        v = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return v[0] if len(v) == 1 else v

    def left(self) -> int:
        return len(self.buf) - self.pos

    def string(self, what: str) -> str:
        n = self.take("Q")
        if n > self.left():
            raise FormatError(f"{self.path}: {what}: a string of {n} bytes runs past the end of the file")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="surrogateescape")

    def value(self, vtype: int, key: str, depth: int = 0):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == 8:
            return self.string(f"metadata key {key}")
        if vtype != 9:
            raise FormatError(f"{self.path}: metadata key {key}: unknown value type {vtype} at byte {self.pos}")
        if depth >= MAX_NESTING:
            raise FormatError(f"{self.path}: metadata key {key}: arrays nested more than {MAX_NESTING} deep")
        item_type, count = self.take("I"), self.take("Q")
        if item_type in _NUMPY:
            nbytes = count * np.dtype(_NUMPY[item_type]).itemsize
            if nbytes > self.left():
                raise FormatError(f"{self.path}: metadata key {key}: an array of {count} items runs past "
                                  f"the end of the file")
            arr = np.frombuffer(self.buf, dtype=_NUMPY[item_type], count=count, offset=self.pos)
            self.pos += nbytes
            return arr.tolist()
        # a string item takes at least its 8-byte length, an array item its 12-byte header
        if count * (8 if item_type == 8 else 12) > self.left():
            raise FormatError(f"{self.path}: metadata key {key}: an array of {count} items runs past "
                              f"the end of the file")
        return [self.value(item_type, key, depth + 1) for _ in range(count)]


def _alignment(kv: dict, path: Path) -> int:
    align = kv.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
        raise FormatError(f"{path}: metadata key general.alignment = {align!r} is not a power of two")
    return align


def _tensor_info(cur: _Cursor, size: int):
    name = cur.string("a tensor name")
    n_dims = cur.take("I")
    if n_dims > MAX_DIMS:
        raise FormatError(f"{cur.path}: tensor {name} has {n_dims} dimensions (ggml allows at most {MAX_DIMS})")
    ne = [cur.take("Q") for _ in range(n_dims)]
    elements = 1
    for d in ne:
        elements *= d
    # no ggml type stores fewer than one bit per weight
    if 0 in ne or elements > 8 * size:
        raise FormatError(f"{cur.path}: tensor {name} has dimensions {ne}, impossible in a file of {size} bytes")
    return name, ne, cur.take("I"), cur.take("Q")


def read_gguf(path) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor table; FormatError on anything malformed.

    Every count and length is checked against the bytes left before anything is allocated, so a
    flipped bit costs a clear error, never gigabytes or minutes."""
    path = Path(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise FormatError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise FormatError(f"{path}: is a directory, not a GGUF file") from None
    if magic != MAGIC:
        raise FormatError(f"{path}: not a GGUF file (magic {magic!r})")
    mm = memmap(path)
    cur = _Cursor(memoryview(mm), path)
    try:
        cur.pos = 4
        version = cur.take("I")
        if version not in (2, 3):
            hint = " (big-endian files are not supported)" if version > 0xFFFF else ""
            raise UnsupportedError(f"{path}: GGUF version {version} is not supported{hint}")
        n_tensors, n_kv = cur.take("Q"), cur.take("Q")
        # a key-value pair takes at least 13 bytes, a tensor info at least 25
        if n_tensors * 25 > size or n_kv * 13 > size:
            raise FormatError(f"{path}: corrupt header ({n_tensors} tensors, {n_kv} keys in {size} bytes)")
        kv = {}
        for _ in range(n_kv):
            key = cur.string("a metadata key")
            if len(key) > MAX_KEY_BYTES or key in kv:
                raise FormatError(f"{path}: metadata key {key[:80]!r} is repeated or too long")
            kv[key] = cur.value(cur.take("I"), key)
        infos = [_tensor_info(cur, size) for _ in range(n_tensors)]
    except struct.error:
        raise FormatError(f"{path}: truncated (the header ends past the end of the file at {size} bytes)") from None
    align = _alignment(kv, path)
    data_start = -(-cur.pos // align) * align
    misaligned = next((name for name, _, _, off in infos if off % align), None)
    if misaligned is not None:
        raise FormatError(f"{path}: tensor {misaligned} starts at a data offset that is not a multiple of "
                          f"the alignment {align}")
    tensors = {name: TensorInfo(name, ggml, tuple(int(d) for d in reversed(ne)) or (1,), data_start + off)
               for name, ne, ggml, off in infos}
    if len(tensors) != len(infos):
        raise FormatError(f"{path}: duplicate tensor names")
    _check_tiling(path, tensors, size, align)
    return GGUFFile(path, version, kv, tensors, size)


def _known_bytes(info: TensorInfo) -> int | None:
    try:
        return info.nbytes if info.qtype else None
    except UnsupportedError:        # rows that are not whole blocks: the converter names the tensor
        return None


def _check_tiling(path: Path, tensors: dict[str, TensorInfo], size: int, align: int) -> None:
    """GGUF writers lay tensors end to end, each padded to the alignment. A tensor whose type or
    shape was corrupted (same-size or not) then overlaps its successor or leaves a gap; a corrupted
    offset does the same. Tensors of types Strata does not know end the check (their size is unknown)."""
    spans = sorted(tensors.values(), key=lambda t: t.offset)
    for i, t in enumerate(spans):
        nbytes = _known_bytes(t)
        if nbytes is None:
            continue
        end = t.offset + nbytes
        if end > size:
            raise FormatError(f"{path}: truncated: tensor {t.name} ends at byte {end} but the file has {size} bytes")
        nxt = spans[i + 1].offset if i + 1 < len(spans) else None
        padded = -(-end // align) * align
        if nxt is not None and nxt != padded:
            raise FormatError(f"{path}: tensor {t.name} ({t.qtype} {list(t.shape)}) ends at byte {end}, but the "
                              f"next tensor starts at {nxt}: a corrupt type, shape or offset")
        if nxt is None and size - end >= align:
            raise FormatError(f"{path}: {size - end} bytes after the last tensor {t.name}: a corrupt type or shape")


def check_extents(g: GGUFFile, names) -> None:
    """FormatError when a tensor's bytes run past the end of the file (a truncated download)."""
    for name in names:
        info = g.tensors[name]
        end = info.offset + info.nbytes
        if end > g.size:
            raise FormatError(f"{g.path}: truncated: tensor {name} ends at byte {end} "
                              f"but the file has {g.size} bytes")
