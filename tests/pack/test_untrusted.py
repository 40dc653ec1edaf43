"""The cases issue #20 found, one test each: a damaged GGUF or pack fails at convert or open, in one line.

GGUF edits go through tests/pack/fuzz.py's own walker (parse_gguf/write_gguf), which rewrites the
header and keeps the data section, so each edit changes exactly one thing.
"""
import json
import struct
import time

import numpy as np
import pytest

from strata.errors import FormatError, PackError
from strata.pack import convert, open_pack
from tests.pack.fuzz import _nested, make_bases, parse_gguf, write_gguf


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return make_bases(tmp_path_factory.mktemp("untrusted"))


def _edited_gguf(bases, tmp_path, edit):
    g = parse_gguf(open(bases["gguf"], "rb").read())
    edit(g)
    path = tmp_path / "bad.gguf"
    path.write_bytes(write_gguf(g))
    return path


def _set_kv(key, vtype, raw):
    def edit(g):
        g.kvs = [kv for kv in g.kvs if kv[0] != key] + [[key, vtype, raw]]
    return edit


def _convert_fails(path, tmp_path, *patterns):
    t0 = time.monotonic()
    with pytest.raises(FormatError) as info:
        convert(path, tmp_path / "out", progress=False)
    assert time.monotonic() - t0 < 5
    msg = str(info.value)
    assert "\n" not in msg and all(p in msg for p in patterns), msg
    assert not (tmp_path / "out").exists()


U32, F32, STR = 4, 6, 8


@pytest.mark.parametrize("key,vtype,raw,patterns", [
    ("qwen3moe.block_count", 10, struct.pack("<Q", 1 << 40), ["block_count"]),        # a flipped high bit
    ("qwen3moe.block_count", U32, struct.pack("<I", 1), ["block_count", "2 blocks"]),   # a layer dropped
    ("qwen3moe.embedding_length", F32, struct.pack("<f", np.inf), ["embedding_length", "not an integer"]),
    ("qwen3moe.expert_count", *_nested(5000), ["expert_count", "nested"]),
    ("general.alignment", STR, struct.pack("<Q", 2) + b"32", ["general.alignment"]),
    ("general.alignment", U32, struct.pack("<I", 24), ["general.alignment", "power of two"]),
    ("qwen3moe.rope.freq_base", F32, struct.pack("<f", 0.0), ["rope_theta"]),
    ("qwen3moe.rope.freq_base", F32, struct.pack("<f", np.nan), ["rope.freq_base"]),
    ("qwen3moe.attention.layer_norm_rms_epsilon", F32, struct.pack("<f", -1.0), ["rms_norm_eps"]),
    ("qwen3moe.attention.layer_norm_rms_epsilon", F32, struct.pack("<f", np.nan), ["layer_norm_rms_epsilon"]),
    ("tokenizer.chat_template", U32, struct.pack("<I", 7), ["chat_template", "not a string"]),
    ("tokenizer.chat_template", STR, struct.pack("<Q", 5) + b"{{ x ", ["chat_template", "does not compile"]),
    ("tokenizer.ggml.tokens", U32, struct.pack("<I", 7), ["tokenizer.ggml.tokens", "strings"]),
    ("tokenizer.ggml.merges", 9, struct.pack("<IQ", STR, 1 << 40), ["tokenizer.ggml.merges", "past the end"]),
])
def test_bad_metadata(bases, tmp_path, key, vtype, raw, patterns):
    _convert_fails(_edited_gguf(bases, tmp_path, _set_kv(key, vtype, raw)), tmp_path, "bad.gguf", *patterns)


@pytest.mark.parametrize("value", [3.2e38, np.nan, -np.inf])
def test_corrupt_float_weight_fails_at_convert(bases, tmp_path, value):
    """A float weight no training makes (an f32 exponent bit flipped: 1.0 -> 3.2e38; NaN; inf) is
    refused at convert, naming the tensor: loaded, it would overflow the first norm and every logit
    after it would be NaN, a model that loads and answers garbage."""
    import gguf
    t = next(t for t in gguf.GGUFReader(bases["gguf"]).tensors if t.name == "output_norm.weight")
    assert t.tensor_type.name == "F32"
    data = bytearray(open(bases["gguf"], "rb").read())
    struct.pack_into("<f", data, int(t.data_offset) + 4 * 3, value)
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    _convert_fails(path, tmp_path, "output_norm.weight", "F32", "element 3")


def _tensor(g, name):
    return next(t for t in g.tensors if t[0] == name)


@pytest.mark.parametrize("edit,patterns", [
    (lambda g: _tensor(g, "blk.0.ffn_gate_exps.weight").__setitem__(1, []), ["ffn_gate_exps", "3 dimensions"]),
    (lambda g: _tensor(g, "blk.1.attn_q.weight").__setitem__(3, _tensor(g, "blk.1.attn_k.weight")[3]),
     ["blk.1.attn"]),                                                   # two tensors on the same bytes
    (lambda g: _tensor(g, "output_norm.weight").__setitem__(2, 1), ["output_norm", "corrupt type"]),  # F32 -> F16
    (lambda g: _tensor(g, "output.weight").__setitem__(3, _tensor(g, "output.weight")[3] + 1), ["alignment"]),
])
def test_bad_tensor_info(bases, tmp_path, edit, patterns):
    _convert_fails(_edited_gguf(bases, tmp_path, edit), tmp_path, "bad.gguf", *patterns)


def test_tokenizer_panic_is_a_format_error(bases, tmp_path, monkeypatch):
    class PanicException(BaseException):     # what pyo3 raises for a Rust panic
        pass

    def panic(*_):
        raise PanicException("called `Option::unwrap()` on a `None` value")

    monkeypatch.setattr("strata.pack.tokenizer_build._build_bpe", panic)
    with pytest.raises(FormatError, match="the tokenizer does not build .*unwrap"):
        convert(bases["gguf"], tmp_path / "out", progress=False)


def _edited_pack(bases, tmp_path, edit):
    import shutil
    dst = tmp_path / "pack"
    shutil.copytree(bases["pack"], dst)
    meta = json.loads((dst / "pack.json").read_text())
    edit(meta)
    (dst / "pack.json").write_text(json.dumps(meta))
    return dst


def _layer(meta, i=1):
    return meta["experts"]["layers"][i]


@pytest.mark.parametrize("edit,patterns", [
    (lambda m: _layer(m).__setitem__("offset", -_layer(m)["offset"]), ["layers[1].offset"]),
    (lambda m: _layer(m).__setitem__("stride", 0), ["layers[1].stride"]),
    (lambda m: m["dense"]["output.weight"].__setitem__("offset", m["dense"]["output.weight"]["offset"] + 1),
     ["output.weight", "offset"]),
    (lambda m: m["model_args"].__setitem__("rms_norm_eps", float("nan")), ["rms_norm_eps"]),
    (lambda m: m["model_args"].__setitem__("rope_theta", 0.0), ["rope_theta"]),
    (lambda m: m["model_args"].__setitem__("num_hidden_layers", 1 << 40), ["layers"]),
    (lambda m: m["model_args"].__setitem__("hidden_size", 64.5), ["hidden_size"]),
    (lambda m: m["dense"]["blk.0.attn_q.weight"].__setitem__("qtype", "F16"), ["blk.0.attn_q", "nbytes"]),
    (lambda m: m["tokenizer"].__setitem__("chat_template", 7), ["chat_template"]),
    (lambda m: m["tokenizer"].__setitem__("eos_token_ids", [10 ** 6]), ["eos_token_ids"]),
    (lambda m: m["tokenizer"].__setitem__("eos_token_ids", [None]), ["eos_token_ids", "None"]),
    (lambda m: m["tokenizer"].__setitem__("fim_token_ids", [1, 2]), ["fim_token_ids", "three"]),
    (lambda m: m["tokenizer"].__setitem__("fim_token_ids", [1, 2, 10 ** 6]), ["fim_token_ids", "1000000"]),
    (lambda m: m["tokenizer"].__setitem__("file", "../../etc/passwd"), ["tokenizer.file"]),
    (lambda m: m.__setitem__("max_blob", 0), ["max_blob"]),
    (lambda m: m["files"]["dense.bin"].__setitem__("bytes", "71936"), ["files.dense.bin.bytes"]),
])
def test_bad_pack_json_fails_at_open(bases, tmp_path, edit, patterns):
    with pytest.raises(PackError) as info:
        open_pack(_edited_pack(bases, tmp_path, edit))
    msg = str(info.value)
    assert "\n" not in msg and "pack.json" in msg and all(p in msg for p in patterns), msg


def test_valid_pack_still_opens(bases):
    with open_pack(bases["pack"]) as p:
        assert p.args.num_hidden_layers == 2 and p.expert(1, 3)["down"].shape == (64, 32)


def test_tokenizer_larger_than_the_vocabulary_fails_at_load(bases, tmp_path):
    """A tokenizer whose ids run past the embedding (tokenizer.json rewritten, its hash updated to match)
    is refused when the model loads, not at the first prompt that encodes such a token."""
    import hashlib
    import shutil

    from strata import LLM
    dst = tmp_path / "pack"
    shutil.copytree(bases["pack"], dst)
    meta = json.loads((dst / "pack.json").read_text())
    tok = json.loads((dst / "tokenizer.json").read_text())
    vocab = meta["model_args"]["vocab_size"]
    tok["added_tokens"].append({"id": vocab + 5, "content": "<|beyond|>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    raw = json.dumps(tok).encode()
    (dst / "tokenizer.json").write_bytes(raw)
    meta["files"]["tokenizer.json"] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (dst / "pack.json").write_text(json.dumps(meta))
    with pytest.raises(PackError, match="more than the model's vocabulary") as info:
        LLM(dst, device="cpu")
    assert "\n" not in str(info.value)
