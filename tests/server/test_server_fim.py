"""Fill-in-the-middle (`suffix` on /v1/completions): the model's own prefix/suffix/middle tokens
(Tokenizer.fill_in_the_middle), found by name in the vocabulary or from the pack's metadata; a model
without them answers 400 naming suffix."""
import json

import httpx
import pytest

import strata
from strata.errors import InvalidArgument
from strata.server import create_app
from strata.tokenizer import Tokenizer
from tests.server.helpers import LiveServer

NAMES = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]


@pytest.fixture(scope="module")
def fim_pack(tmp_path_factory):
    """The demo pack with Qwen-Coder's three FIM tokens taking the place of three rare ones (its
    tokenizer.json only, so the model's vocabulary size stays)."""
    import hashlib
    import shutil
    from strata.engine.llm import demo_model_path
    dst = tmp_path_factory.mktemp("fim") / "pack"
    shutil.copytree(demo_model_path(), dst)
    tok = json.loads((dst / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    rare = sorted(vocab.values())[-3:]
    by_id = {i: t for t, i in vocab.items()}
    for name, i in zip(NAMES, rare):
        del vocab[by_id[i]]
        tok["added_tokens"].append({"id": i, "content": name, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
    tok["model"]["merges"] = [m for m in tok["model"]["merges"]
                              if "".join(m if isinstance(m, list) else m.split(" ")) not in {by_id[i] for i in rare}]
    raw = json.dumps(tok).encode()
    (dst / "tokenizer.json").write_bytes(raw)
    pack = json.loads((dst / "pack.json").read_text())
    pack["files"]["tokenizer.json"] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (dst / "pack.json").write_text(json.dumps(pack))
    (dst / ".verified.json").unlink(missing_ok=True)      # the copy's files are checked again
    return dst, rare


def test_fim_tokens_are_found_by_name_or_metadata(fim_pack):
    path, rare = fim_pack
    meta = json.loads((path / "pack.json").read_text())["tokenizer"]
    tok = Tokenizer(path / "tokenizer.json", meta)
    assert tok.fim_token_ids == tuple(rare)
    ids = tok.fill_in_the_middle("def add(a, b):\n    return ", "\n\nprint(add(1, 2))")
    assert ids[0] == rare[0] and ids[-1] == rare[2] and ids.count(rare[1]) == 1
    assert tok.decode(ids, skip_special_tokens=False) == (NAMES[0] + "def add(a, b):\n    return " + NAMES[1]
                                                          + "\n\nprint(add(1, 2))" + NAMES[2])
    assert Tokenizer(path / "tokenizer.json", {**meta, "fim_token_ids": [5, 6, 7]}).fim_token_ids == (5, 6, 7)
    plain = strata.LLM(device="cpu").tokenizer
    assert plain.fim_token_ids is None
    with pytest.raises(InvalidArgument, match="no fill-in-the-middle tokens"):
        plain.fill_in_the_middle("a", "b")


def test_suffix_fills_the_middle(fim_pack):
    path, rare = fim_pack
    llm, ref = strata.LLM(str(path), device="cpu"), strata.LLM(str(path), device="cpu")
    live = LiveServer(create_app(llm, queue_size=4, warm_up=False))
    try:
        prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))"
        r = httpx.post(live.url + "/v1/completions", json={"prompt": prefix, "suffix": suffix, "max_tokens": 8,
                                                           "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        want = ref.generate(ref.tokenizer.fill_in_the_middle(prefix, suffix), max_tokens=8)
        assert r.json()["choices"][0]["text"] == want.text
        assert r.json()["usage"]["prompt_tokens"] == len(ref.tokenizer.fill_in_the_middle(prefix, suffix))
        bad = httpx.post(live.url + "/v1/completions", json={"prompt": prefix, "suffix": suffix, "echo": True},
                         timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "suffix"
    finally:
        live.close()
