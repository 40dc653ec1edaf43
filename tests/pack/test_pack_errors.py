"""Bad inputs become one clear Strata error, and conversions are atomic."""
import json
import os

import pytest

from strata.errors import FormatError, InvalidArgument, PackError, UnsupportedError
from strata.pack import convert, open_pack
from strata.pack.format import is_pack_dir
from tests.fixtures import SHAPES, make_gguf, make_hf_dir
from tests.pack import gguf_edit


@pytest.fixture
def gguf_path(tmp_path):
    return make_gguf(tmp_path, SHAPES["tiny"], seed=11)[0][0]


def _convert_error(src, tmp_path, error, *patterns):
    dst = tmp_path / "out"
    with pytest.raises(error) as info:
        convert(src, dst, progress=False)
    msg = str(info.value)
    assert "\n" not in msg
    for p in patterns:
        assert p in msg, msg
    assert not dst.exists() and not list(tmp_path.glob("out.tmp-*"))
    return msg


def test_truncated_data(gguf_path, tmp_path):
    bad = gguf_edit.copy(gguf_path, tmp_path / "cut.gguf")
    gguf_edit.truncate(bad, bad.stat().st_size - 1000)
    _convert_error(bad, tmp_path, FormatError, "cut.gguf", "truncated")


def test_truncated_header(gguf_path, tmp_path):
    bad = gguf_edit.copy(gguf_path, tmp_path / "cut.gguf")
    gguf_edit.truncate(bad, 300)
    _convert_error(bad, tmp_path, FormatError, "cut.gguf", "truncated")


def test_wrong_magic(gguf_path, tmp_path):
    bad = gguf_edit.copy(gguf_path, tmp_path / "x.gguf")
    gguf_edit.replace_in_header(bad, b"GGUF", b"GGML")
    _convert_error(bad, tmp_path, FormatError, "x.gguf: not a GGUF file (magic b'GGML')")
    (tmp_path / "empty.gguf").write_bytes(b"")
    _convert_error(tmp_path / "empty.gguf", tmp_path, FormatError, "not a GGUF file (magic b'')")


def test_unsupported_architecture(gguf_path, tmp_path):
    bad = gguf_edit.copy(gguf_path, tmp_path / "x.gguf")
    gguf_edit.replace_in_header(bad, b"qwen3moe", b"qwen2moe", count=3)
    _convert_error(bad, tmp_path, UnsupportedError, "x.gguf", "architecture 'qwen2moe'")


def test_unsupported_quant_type(gguf_path, tmp_path):
    bad = gguf_edit.copy(gguf_path, tmp_path / "x.gguf")
    gguf_edit.set_tensor_type(bad, "blk.1.ffn_down_exps.weight", 16)     # IQ2_XXS
    _convert_error(bad, tmp_path, UnsupportedError, "x.gguf", "blk.1.ffn_down_exps.weight", "IQ2_XXS")


def test_missing_tensor_and_key(gguf_path, tmp_path):
    bad = gguf_edit.copy(gguf_path, tmp_path / "x.gguf")
    gguf_edit.replace_in_header(bad, b"blk.1.attn_k.weight", b"blk.1.attn_x.weight")
    _convert_error(bad, tmp_path, FormatError, "x.gguf", "missing tensors blk.1.attn_k.weight")
    bad = gguf_edit.copy(gguf_path, tmp_path / "y.gguf")
    gguf_edit.replace_in_header(bad, b"qwen3moe.expert_count", b"qwen3moe.expert_cnunt")
    _convert_error(bad, tmp_path, FormatError, "y.gguf", "missing metadata key qwen3moe.expert_count")


def test_unsupported_tokenizer_model(gguf_path, tmp_path):
    bad = gguf_edit.copy(gguf_path, tmp_path / "x.gguf")
    gguf_edit.replace_in_header(bad, b"\x04\x00\x00\x00\x00\x00\x00\x00gpt2", b"\x04\x00\x00\x00\x00\x00\x00\x00bert")
    _convert_error(bad, tmp_path, UnsupportedError, "x.gguf", "tokenizer model 'bert'")


def test_missing_split(tmp_path):
    paths, _ = make_gguf(tmp_path, SHAPES["tiny"], seed=12, split=2)
    paths[1].unlink()
    _convert_error(paths[0], tmp_path, FormatError, paths[1].name)


def test_missing_source(tmp_path):
    with pytest.raises(InvalidArgument, match="no such file"):
        convert(tmp_path / "nope.gguf", tmp_path / "out", progress=False)


def test_corrupted_data_file(gguf_path, tmp_path):
    pack = convert(gguf_path, tmp_path / "pack", progress=False)
    open_pack(pack)
    with open(pack / "experts.bin", "r+b") as f:
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(PackError, match=r"experts\.bin: sha256 mismatch"):
        open_pack(pack)
    open_pack(pack, verify=False)   # sizes still hold: an explicit opt-out loads


@pytest.mark.parametrize("victim", ["dense.bin", "experts.bin", "tokenizer.json", "pack.json"])
def test_missing_file(gguf_path, tmp_path, victim):
    pack = convert(gguf_path, tmp_path / "pack", progress=False)
    (pack / victim).unlink()
    with pytest.raises(PackError, match=victim.replace(".", r"\.")):
        open_pack(pack)


def test_truncated_pack_file_and_other_version(gguf_path, tmp_path):
    pack = convert(gguf_path, tmp_path / "pack", progress=False)
    meta = json.loads((pack / "pack.json").read_text())
    gguf_edit.truncate(pack / "dense.bin", 1000)
    with pytest.raises(PackError, match=r"dense\.bin: 1000 bytes"):
        open_pack(pack, verify=False)
    (pack / "pack.json").write_text(json.dumps({**meta, "version": 2}))
    with pytest.raises(PackError, match="version 2"):
        open_pack(pack)


class _Killed(BaseException):
    pass


def _kill_after(monkeypatch, calls):
    from strata.pack.progress import Progress
    real = Progress.advance
    count = [0]

    def advance(self, nbytes, what=""):
        count[0] += 1
        if count[0] > calls:
            raise _Killed()
        real(self, nbytes, what)
    monkeypatch.setattr(Progress, "advance", advance)


def test_killed_conversion_leaves_no_pack(gguf_path, tmp_path, monkeypatch):
    _kill_after(monkeypatch, 24)        # 21 dense tensors, then part-way through the experts
    with pytest.raises(_Killed):
        convert(gguf_path, tmp_path / "pack", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [gguf_path.name]


def test_killed_without_cleanup_leaves_nothing_loadable(gguf_path, tmp_path, monkeypatch):
    import strata.pack.converter as conv
    monkeypatch.setattr(conv.shutil, "rmtree", lambda *a, **k: None)   # as if SIGKILLed: no cleanup
    _kill_after(monkeypatch, 24)
    with pytest.raises(_Killed):
        convert(gguf_path, tmp_path / "pack", progress=False)
    leftovers = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert [p.name for p in leftovers] == [f"pack.tmp-{os.getpid()}"]
    assert not is_pack_dir(leftovers[0])
    with pytest.raises(PackError, match="missing pack.json"):
        open_pack(leftovers[0])


def test_killed_replacement_keeps_the_old_pack(tmp_path, monkeypatch):
    old_src, new_src = (make_gguf(tmp_path, SHAPES["tiny"], seed=s, name=f"m{s}")[0][0] for s in (1, 2))
    dst = convert(old_src, tmp_path / "pack", progress=False)
    before = (dst / "experts.bin").read_bytes()
    _kill_after(monkeypatch, 5)
    with pytest.raises(_Killed):
        convert(new_src, dst, progress=False)
    assert (dst / "experts.bin").read_bytes() == before
    open_pack(dst)


def test_existing_destination(gguf_path, tmp_path):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "mine.txt").write_text("keep me")
    with pytest.raises(InvalidArgument, match="not a Strata pack; refusing"):
        convert(gguf_path, other, progress=False)
    assert (other / "mine.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidArgument, match="refusing"):
        convert(gguf_path, tmp_path / "file", progress=False)
    # a pack is replaced (atomically), an empty directory filled
    dst = convert(gguf_path, tmp_path / "pack", progress=False)
    new_src = make_gguf(tmp_path, SHAPES["odd"], seed=3, name="odd")[0][0]
    assert open_pack(convert(new_src, dst, progress=False)).args.hidden_size == 96
    (tmp_path / "empty").mkdir()
    open_pack(convert(gguf_path, tmp_path / "empty", progress=False))
    assert not list(tmp_path.glob("*.tmp-*")) and not list(tmp_path.glob("*.old-*"))


def test_hf_missing_tensor_and_files(tmp_path):
    from safetensors.numpy import load_file, save_file
    hf, _ = make_hf_dir(tmp_path, SHAPES["tiny"], seed=13)
    tensors = load_file(str(hf / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(hf / "model.safetensors"))
    _convert_error(hf, tmp_path, FormatError, "missing tensor model.layers.1.mlp.experts.3.up_proj.weight")
    (hf / "model.safetensors").write_bytes(b"\xff" * 7)
    _convert_error(hf, tmp_path, FormatError, "model.safetensors", "truncated")
    (hf / "config.json").unlink()
    _convert_error(hf, tmp_path, FormatError, "missing config.json")
