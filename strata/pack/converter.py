"""convert(): a GGUF file or HF checkpoint -> a pack directory, streamed and atomic.

Tensors are written one at a time (one expert at a time for experts.bin) from memory maps, hashed as
they are written, into `dst.tmp-<pid>` beside dst. pack.json goes last, after every data file is
fsynced, and the directory is renamed into place, so an interrupted conversion never leaves a
directory at dst (and never one with a pack.json anywhere but in a finished pack).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np

from ..errors import FormatError, InvalidArgument
from ..quant import qtype as qtype_of
from .format import FORMAT, VERSION, is_pack_dir, layout, write_stamp
from .progress import Progress
from .source import EXPERT_PARTS, Source


class _HashedFile:
    """A binary file that hashes what it writes and zero-fills gaps up to aligned offsets."""

    def __init__(self, path: Path):
        self.path, self.f, self.pos, self.sha = path, open(path, "wb", buffering=1 << 20), 0, hashlib.sha256()

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        self.f.write(mv)
        self.sha.update(mv)
        self.pos += mv.nbytes

    def pad_to(self, offset: int) -> None:
        if offset < self.pos:
            raise AssertionError(f"{self.path}: writing backwards ({self.pos} > {offset})")
        if offset > self.pos:
            self.write(bytes(offset - self.pos))

    def close(self) -> dict:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {"bytes": self.pos, "sha256": self.sha.hexdigest()}


def _checked(data, nbytes: int, what: str):
    if data.nbytes != nbytes:
        raise FormatError(f"{what}: {data.nbytes} bytes where {nbytes} were expected")
    return data


# A float weight this large is corruption, not training: trained norm gains, embeddings and router
# rows stay far below it, while one bit flipped in an f32 exponent (1.0 -> 1.7e38) overflows the
# first RMSNorm to inf and every logit after it to NaN: a model that loads and answers garbage.
FLOAT_WEIGHT_LIMIT = 1e8


def _finite_weights(data, qtype: str, what: str, chunk: int = 1 << 22):
    """data (a float tensor's bytes) unless a value is NaN, infinite or beyond FLOAT_WEIGHT_LIMIT,
    read chunk values at a time (an F16 embedding of a large vocabulary stays a few MB of f32 here)."""
    if qtype not in ("F32", "F16", "BF16"):
        return data
    raw = np.frombuffer(memoryview(data).cast("B"), np.uint8)
    vals = raw.view({"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[qtype])
    for lo in range(0, vals.size, chunk):
        part = vals[lo:lo + chunk]
        x = (part.astype(np.uint32) << 16).view(np.float32) if qtype == "BF16" else part.astype(np.float32)
        bad = ~(np.abs(x) <= FLOAT_WEIGHT_LIMIT)            # NaN compares false: bad too
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise FormatError(f"{what}: {qtype} value {float(x[i])!r} at element {lo + i} is not a finite weight "
                              f"within {FLOAT_WEIGHT_LIMIT:g} (a corrupt file?)")
    return data


def write_pack(source: Source, out: Path, progress: Progress) -> dict:
    """Write a complete pack for `source` into the (new, empty) directory `out`; returns pack.json."""
    source_entry = source.stat_entry()     # before reading: a source edited meanwhile looks changed
    plan = layout(source.dense, source.experts, source.args.num_experts)
    plan.pop("_sizes")
    progress.start(sum(t["nbytes"] for t in plan["dense"].values())
                   + sum(lay["blob_bytes"] for lay in plan["experts"]["layers"]) * source.args.num_experts)
    files = {}
    w = _HashedFile(out / "dense.bin")
    for spec in source.dense:
        entry = plan["dense"][spec.name]
        w.pad_to(entry["offset"])
        w.write(_finite_weights(_checked(spec.read(), entry["nbytes"], spec.name), spec.qtype, spec.name))
        progress.advance(entry["nbytes"], spec.name)
    files["dense.bin"] = w.close()
    w = _HashedFile(out / "experts.bin")
    for lay, parts in zip(plan["experts"]["layers"], source.experts):
        for e in range(source.args.num_experts):
            w.pad_to(lay["offset"] + e * lay["stride"])
            for p in EXPERT_PARTS:
                w.write(_checked(parts[p].read(e), lay["parts"][p]["nbytes"], f"layer {lay['layer']} expert {e} {p}"))
            progress.advance(lay["blob_bytes"], f"experts of layer {lay['layer']}")
        w.pad_to(lay["offset"] + source.args.num_experts * lay["stride"])
    files["experts.bin"] = w.close()
    w = _HashedFile(out / "tokenizer.json")
    w.write(source.tokenizer_json().encode("utf-8"))
    files["tokenizer.json"] = w.close()
    meta = {"format": FORMAT, "version": VERSION, "model_args": source.args.to_dict(),
            "tokenizer": {"file": "tokenizer.json", **source.tokenizer_meta}, **plan,
            "files": files, "source": source_entry}
    if source.notes:
        meta["notes"] = source.notes
        progress.note(source.notes)
    with open(out / "pack.json", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    write_stamp(out, {n: [v["bytes"], (out / n).stat().st_mtime_ns, v["sha256"]] for n, v in files.items()})
    _fsync_dir(out)
    progress.finish()
    return meta


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_source(src, qtype: str | None = None) -> Source:
    """The Source of a GGUF file (or any split of one) or a HF checkpoint directory."""
    src = Path(src)
    if src.is_dir():
        from .hf_qwen3next import is_qwen3next, open_qwen3next_source
        if is_qwen3next(src):
            return open_qwen3next_source(src, qtype)
        from .hf_source import open_hf_source
        return open_hf_source(src, qtype)
    if not src.exists():
        raise InvalidArgument(f"{src}: no such file or directory")
    if qtype is not None:
        raise InvalidArgument(f"{src}: qtype applies to Hugging Face sources; GGUF tensors keep their block bytes")
    from .gguf_qwen3next import is_qwen3next_gguf, open_qwen3next_gguf
    if is_qwen3next_gguf(src):
        return open_qwen3next_gguf(src)
    from .gguf_source import open_gguf_source
    return open_gguf_source(src)


def _check_qtype(qtype: str | None) -> str | None:
    if qtype is None:
        return None
    from ..quant.quantize import QUANTIZABLE
    name = qtype_of(qtype).name
    if name not in QUANTIZABLE:
        raise InvalidArgument(f"qtype {qtype!r}: Strata cannot quantize to {name} "
                              f"(choose from {', '.join(QUANTIZABLE)})")
    return name


def _check_dst(dst: Path) -> None:
    if not dst.exists():
        return
    if dst.is_dir() and (is_pack_dir(dst) or not any(dst.iterdir())):
        return
    raise InvalidArgument(f"{dst}: exists and is not a Strata pack; refusing to overwrite it")


def _remove_stale_tmp(dst: Path) -> None:
    """Drop `dst.tmp-<pid>` directories left by conversions whose process is gone."""
    pattern = re.compile(re.escape(dst.name) + r"\.(?:tmp|old)-(\d+)$")
    for p in dst.parent.iterdir():
        m = pattern.match(p.name)
        if m and p.is_dir() and not _alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux renameat2 RENAME_EXCHANGE); False where unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _install(tmp: Path, dst: Path) -> None:
    """Move the finished pack at tmp to dst, replacing an existing pack (or empty dir) there."""
    if not dst.exists():
        os.rename(tmp, dst)
    elif _exchange(tmp, dst):
        shutil.rmtree(tmp)              # tmp now holds the old pack
    else:
        old = dst.with_name(f"{dst.name}.old-{os.getpid()}")
        os.rename(dst, old)
        os.rename(tmp, dst)
        shutil.rmtree(old)
    _fsync_dir(dst.parent)


def convert(src, dst, qtype: str | None = None, progress: bool = True) -> Path:
    """Convert a GGUF file (or the first split) or a HF safetensors directory into a pack at dst.

    qtype (HF sources only): quantize matrices to this type (strata.quant.quantize.QUANTIZABLE);
    None keeps F32/F16/BF16 as stored. An existing dst is replaced only when it is a pack (or an
    empty directory). Returns dst.
    """
    dst = Path(dst).absolute()
    qtype = _check_qtype(qtype)
    _check_dst(dst)
    return write_source(open_source(src, qtype), dst, f"converting {Path(src).name}", progress)


def write_source(source: Source, dst: Path, label: str, progress: bool = True) -> Path:
    """Write `source` as a pack at dst, atomically (a temporary dir renamed into place); closes source."""
    dst = Path(dst).absolute()
    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(dst)
    tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_pack(source, tmp, Progress(label, enabled=progress))
        _check_dst(dst)                 # something may have appeared at dst meanwhile
        _install(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        source.close()
    return dst
