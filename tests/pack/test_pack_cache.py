"""resolve_model: packs as-is; GGUF / HF sources converted once into the cache, again when changed."""
import os

import pytest

import strata.pack.cache as cache_mod
from strata.errors import InvalidArgument
from strata.pack import convert, open_pack, resolve_model
from tests.fixtures import SHAPES, make_gguf, make_hf_dir


def _count_conversions(monkeypatch):
    calls = []
    real = cache_mod.convert

    def counted(*args, **kwargs):
        calls.append(args[0])
        kwargs["progress"] = False
        return real(*args, **kwargs)
    monkeypatch.setattr(cache_mod, "convert", counted)
    return calls


def test_gguf_converted_once_and_again_when_touched(tmp_path, monkeypatch):
    calls = _count_conversions(monkeypatch)
    src = make_gguf(tmp_path, SHAPES["tiny"], seed=1)[0][0]
    cache = tmp_path / "cache"
    first = resolve_model(src, str(cache))
    open_pack(first)
    assert first.parent == cache and len(calls) == 1
    assert resolve_model(str(src), str(cache)) == first and len(calls) == 1
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    second = resolve_model(src, str(cache))
    assert second != first and len(calls) == 2
    open_pack(second)
    assert not first.exists()       # the stale conversion of the same source is dropped
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == [second.name]


def test_split_gguf_and_hf_dir(tmp_path, monkeypatch):
    calls = _count_conversions(monkeypatch)
    paths = make_gguf(tmp_path, SHAPES["tiny"], seed=2, split=2)[0]
    a = resolve_model(paths[0], str(tmp_path / "cache"))
    assert resolve_model(paths[0], str(tmp_path / "cache")) == a and len(calls) == 1
    assert open_pack(a).meta["source"]["paths"] == [str(p.resolve()) for p in paths]
    hf, _ = make_hf_dir(tmp_path, SHAPES["tiny"], seed=3)
    b = resolve_model(hf, str(tmp_path / "cache"))
    assert resolve_model(hf, str(tmp_path / "cache")) == b and len(calls) == 2
    open_pack(b)


def test_pack_dir_as_is_and_env_cache_dir(tmp_path, monkeypatch):
    src = make_gguf(tmp_path, SHAPES["tiny"], seed=4)[0][0]
    pack = convert(src, tmp_path / "pack", progress=False)
    assert resolve_model(pack) == pack
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "envcache"))
    _count_conversions(monkeypatch)
    assert resolve_model(src).parent == tmp_path / "envcache"
    with pytest.raises(InvalidArgument, match="no such file"):
        resolve_model(tmp_path / "missing.gguf")
