"""Byte-level edits of GGUF files for bad-input tests (same-length patches keep every offset valid)."""
from __future__ import annotations

import shutil
import struct
from pathlib import Path


def copy(src: Path, dst: Path) -> Path:
    shutil.copyfile(src, dst)
    return dst


def replace_in_header(path: Path, old: bytes, new: bytes, count: int = 1) -> None:
    """Replace the first `count` occurrences of `old` in the metadata part of the file (same length)."""
    assert len(old) == len(new)
    data = bytearray(path.read_bytes())
    head = data[:1 << 16]
    start = 0
    for _ in range(count):
        i = head.find(old, start)
        assert i >= 0, f"{old!r} not found in {path}"
        data[i:i + len(old)] = new
        start = i + len(old)
    path.write_bytes(bytes(data))


def set_tensor_type(path: Path, name: str, ggml_type: int) -> None:
    """Rewrite the ggml type id in a tensor's info record (name, n_dims, ne[n_dims], type, offset)."""
    data = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    i = data.find(key)
    assert i >= 0, f"tensor {name} not found"
    pos = i + len(key)
    n_dims = struct.unpack_from("<I", data, pos)[0]
    pos += 4 + 8 * n_dims
    struct.pack_into("<I", data, pos, ggml_type)
    path.write_bytes(bytes(data))


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)
