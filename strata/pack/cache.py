"""resolve_model(): a pack directory as-is; a GGUF file or HF directory converted once into a cache.

A cached pack is named after the source and a digest of what identifies its bytes on disk (resolved
paths, sizes, mtimes), so an edited or replaced source gets a fresh conversion and the stale pack of
the same source is dropped.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from ..config import env_value
from ..errors import InvalidArgument, PackError
from .converter import convert
from .format import is_pack_dir, read_meta
from .source import source_stat


def default_cache_dir() -> Path:
    return Path(env_value("CACHE_DIR") or "~/.cache/strata").expanduser()


def _source_paths(model: Path) -> tuple[str, list[Path]]:
    if model.is_dir():
        from .hf_source import source_files
        return "hf", source_files(model)
    from .gguf_source import split_paths
    return "gguf", split_paths(model)


def _entry_name(model: Path, stat: dict) -> str:
    digest = hashlib.sha256(json.dumps(stat, sort_keys=True).encode()).hexdigest()[:16]
    stem = model.name[:-5] if model.name.endswith(".gguf") else model.name
    return f"{stem}-{digest}"


def resolve_model(model, cache_dir: str | None = None) -> Path:
    """The pack directory for `model`: a pack dir as-is; a .gguf (or HF checkpoint dir) converted
    once into cache_dir (default ~/.cache/strata, or STRATA_CACHE_DIR) and reused while unchanged."""
    model = Path(model).expanduser()
    if not model.exists():
        raise InvalidArgument(f"model {str(model)!r}: no such file or directory")
    if model.is_dir() and ((model / "pack.json").exists() or not (model / "config.json").exists()):
        return model            # a pack (open_pack reports what is wrong with a broken one)
    kind, paths = _source_paths(model)
    stat = source_stat(paths, kind)
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = cache / _entry_name(model, stat)
    if _cached(target, stat):
        return target
    convert(model, target, progress=True)
    _drop_stale(cache, target, stat["paths"])
    return target


def _cached(target: Path, stat: dict) -> bool:
    try:
        return is_pack_dir(target) and read_meta(target).get("source") == stat
    except PackError:           # another format version: convert again
        return False


def _drop_stale(cache: Path, keep: Path, paths: list[str]) -> None:
    """Remove older cached packs converted from the same source paths."""
    for p in cache.iterdir():
        if p == keep or ".tmp-" in p.name or ".old-" in p.name or not is_pack_dir(p):   # not others' work
            continue
        try:
            if read_meta(p).get("source", {}).get("paths") == paths:
                shutil.rmtree(p, ignore_errors=True)
        except Exception:   # an unreadable entry is not ours to judge
            continue
