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


class _Cursor:
    def __init__(self, buf: bytes | memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        v = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return v[0] if len(v) == 1 else v

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise struct.error("string past the end")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="surrogateescape")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            item_type, count = self.take("I"), self.take("Q")
            if item_type in _NUMPY:
                nbytes = count * np.dtype(_NUMPY[item_type]).itemsize
                if self.pos + nbytes > len(self.buf):
                    raise struct.error("array past the end")
                arr = np.frombuffer(self.buf, dtype=_NUMPY[item_type], count=count, offset=self.pos)
                self.pos += nbytes
                return arr.tolist()
            if count > len(self.buf):
                raise struct.error("array longer than the file")
            return [self.value(item_type) for _ in range(count)]
        raise FormatError(f"{self.path}: unknown metadata value type {vtype} at byte {self.pos}")


def read_gguf(path) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor table; FormatError on anything malformed."""
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
        if n_tensors > size or n_kv > size:
            raise FormatError(f"{path}: corrupt header ({n_tensors} tensors, {n_kv} keys in {size} bytes)")
        kv = {}
        for _ in range(n_kv):
            key = cur.string()
            kv[key] = cur.value(cur.take("I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            ne = [cur.take("Q") for _ in range(cur.take("I"))]
            infos.append((name, ne, cur.take("I"), cur.take("Q")))
    except (struct.error, IndexError, ValueError):
        raise FormatError(f"{path}: truncated (the header ends past the end of the file at {size} bytes)") from None
    align = int(kv.get("general.alignment", DEFAULT_ALIGNMENT) or DEFAULT_ALIGNMENT)
    data_start = -(-cur.pos // align) * align
    tensors = {name: TensorInfo(name, ggml, tuple(int(d) for d in reversed(ne)) or (1,), data_start + off)
               for name, ne, ggml, off in infos}
    if len(tensors) != len(infos):
        raise FormatError(f"{path}: duplicate tensor names")
    return GGUFFile(path, version, kv, tensors, size)


def check_extents(g: GGUFFile, names) -> None:
    """FormatError when a tensor's bytes run past the end of the file (a truncated download)."""
    for name in names:
        info = g.tensors[name]
        end = info.offset + info.nbytes
        if end > g.size:
            raise FormatError(f"{g.path}: truncated: tensor {name} ends at byte {end} "
                              f"but the file has {g.size} bytes")
