"""GGUF -> pack: block bytes copied unchanged (checked with gguf-py's reader), layout rules, splits,
mixed quant types, MTP, tied embeddings, the tokenizer, and logits equal to transformers'."""
import json

import gguf
import numpy as np
import pytest
import torch

from strata.pack import convert, open_pack
from strata.pack.format import BLOB_ALIGN, DENSE_ALIGN
from strata.quant import QTYPES
from tests.fixtures import SHAPES, make_gguf, make_tokenizer

# Every supported type at least once; lists vary a kind's type across the 2 layers.
ALL_TYPES = {"embd": "Q6_K", "output": "Q5_K", "norm": "F32", "router": ["F16", "BF16"],
             "attn_q": ["IQ4_XS", "Q8_0"], "attn_k": ["Q2_K", "Q3_K"], "attn_v": ["IQ4_NL", "Q4_1"],
             "attn_output": ["Q4_0", "Q5_0"], "ffn_gate_exps": ["Q4_K", "Q5_1"],
             "ffn_up_exps": ["Q6_K", "Q2_K"], "ffn_down_exps": ["Q3_K", "Q4_K"]}


def _gguf_tensors(paths):
    out = {}
    for p in paths:
        for t in gguf.GGUFReader(p).tensors:
            out[t.name] = (t.tensor_type.name, np.asarray(t.data).reshape(-1).view(np.uint8))
    return out


def test_all_quant_types_copied_unchanged(tmp_path):
    paths, _ = make_gguf(tmp_path, SHAPES["kquant"], ALL_TYPES, seed=1)
    pack = open_pack(convert(paths[0], tmp_path / "pack", progress=False))
    ref = _gguf_tensors(paths)
    assert {q for q, _ in ref.values()} == set(QTYPES)
    for name in pack.dense_names():
        t = pack.dense(name)
        assert (t.qtype, t.data.tobytes()) == (ref[name][0], ref[name][1].tobytes()), name
        assert pack.meta["dense"][name]["offset"] % DENSE_ALIGN == 0
    E = pack.args.num_experts
    for layer in range(pack.args.num_hidden_layers):
        lay = pack.expert_layout(layer)
        assert lay["offset"] % BLOB_ALIGN == 0 and lay["stride"] % BLOB_ALIGN == 0
        for e in range(E):
            blob = pack.expert_blob(layer, e)
            assert blob.nbytes == lay["blob_bytes"] <= pack.max_blob
            for p, q in pack.expert(layer, e).items():
                qname, data = ref[f"blk.{layer}.ffn_{p}_exps.weight"]
                per = data.nbytes // E
                assert q.qtype == qname and q.data.tobytes() == data[e * per:(e + 1) * per].tobytes()
            assert blob.tobytes() == b"".join(q.data.tobytes() for q in pack.expert(layer, e).values())
    assert pack.max_blob == max(pack.expert_layout(l)["blob_bytes"] for l in range(pack.args.num_hidden_layers))


def test_model_args_from_metadata(tmp_path):
    shape = SHAPES["odd"]
    paths, _ = make_gguf(tmp_path, shape, seed=2)
    a = open_pack(convert(paths[0], tmp_path / "pack", progress=False)).args
    assert (a.vocab_size, a.hidden_size, a.num_hidden_layers, a.num_attention_heads, a.num_key_value_heads,
            a.head_dim, a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size) == (
        300, 96, 3, 4, 2, 24, 6, 3, 64)
    assert (a.rope_theta, a.rms_norm_eps, a.max_position_embeddings) == (1e6, pytest.approx(1e-6), 4096)
    assert a.norm_topk_prob and not a.tie_word_embeddings and a.num_mtp_layers == 0


def test_split_gguf_equals_single_file(tmp_path):
    single, _ = make_gguf(tmp_path / "one", SHAPES["odd"], {"experts": ["Q4_0", "Q8_0", "Q5_1"]}, seed=3)
    split, _ = make_gguf(tmp_path / "three", SHAPES["odd"], {"experts": ["Q4_0", "Q8_0", "Q5_1"]}, seed=3, split=3)
    assert [p.name for p in split] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    a = convert(single[0], tmp_path / "a", progress=False)
    b = convert(split[0], tmp_path / "b", progress=False)
    ma, mb = (json.loads((p / "pack.json").read_text()) for p in (a, b))
    assert mb["source"]["paths"] == [str(p.resolve()) for p in split]
    ma.pop("source"), mb.pop("source")
    assert ma == mb
    for f in ("dense.bin", "experts.bin", "tokenizer.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes()
    # any split names the whole set
    assert json.loads((convert(split[2], tmp_path / "c", progress=False) / "pack.json").read_text())["files"] \
        == ma["files"]


def _logits_match(pack_path, model, vocab):
    import strata
    llm = strata.LLM(str(pack_path), device="cpu")
    ids = list(np.random.default_rng().integers(0, vocab, size=9))
    got = llm.logits(ids)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(got, want, atol=2e-4 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("shape,qtypes", [
    ("odd", {"experts": ["Q4_0", "IQ4_NL", "Q5_1"], "attn": "Q8_0", "embd": "BF16", "output": "F16"}),
    ("kquant", {"experts": ["Q4_K", "Q6_K"], "attn": "IQ4_XS", "embd": "Q6_K", "output": "Q5_K"}),
])
def test_logits_equal_transformers(tmp_path, shape, qtypes):
    paths, model = make_gguf(tmp_path, SHAPES[shape], qtypes, seed=4)
    _logits_match(convert(paths[0], tmp_path / "pack", progress=False), model, SHAPES[shape]["vocab_size"])


def test_tied_embeddings(tmp_path):
    shape = {**SHAPES["tiny"], "tie_word_embeddings": True}
    paths, model = make_gguf(tmp_path, shape, seed=5)
    pack = open_pack(convert(paths[0], tmp_path / "pack", progress=False))
    assert pack.args.tie_word_embeddings and not pack.has_dense("output.weight")
    _logits_match(pack.path, model, shape["vocab_size"])


def test_mtp_layer(tmp_path):
    paths, _ = make_gguf(tmp_path, SHAPES["mtp"], {"nextn": "Q8_0"}, seed=6)
    pack = open_pack(convert(paths[0], tmp_path / "pack", progress=False))
    L = SHAPES["mtp"]["num_hidden_layers"]
    assert pack.args.num_hidden_layers == L and pack.args.num_mtp_layers == 1
    assert len(pack.meta["experts"]["layers"]) == L + 1
    D = SHAPES["mtp"]["hidden_size"]
    assert pack.dense(f"blk.{L}.nextn.eh_proj.weight").shape == (D, 2 * D)
    for n in ("enorm", "hnorm", "shared_head_norm"):
        assert pack.dense(f"blk.{L}.nextn.{n}.weight").shape == (D,)
    assert pack.dense(f"blk.{L}.attn_q.weight").qtype == "Q8_0"
    assert pack.expert(L, 1)["down"].shape == (D, SHAPES["mtp"]["moe_intermediate_size"])


def test_tokenizer_from_gguf_matches_source(tmp_path):
    from tokenizers import Tokenizer
    paths, _ = make_gguf(tmp_path, SHAPES["tiny"], seed=7)
    pack = open_pack(convert(paths[0], tmp_path / "pack", progress=False))
    built, ref = Tokenizer.from_file(str(pack.tokenizer_path)), make_tokenizer(300)
    texts = ["Hello world, the json module!", "  spaces\n\n\ttabs 12345 ünïcödé 日本語 🤖 don't WE'LL",
             "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"]
    for text in texts:
        ids = built.encode(text, add_special_tokens=False).ids
        assert ids == ref.encode(text, add_special_tokens=False).ids
        assert built.decode(ids, skip_special_tokens=False) == text
    im_end, eot = ref.token_to_id("<|im_end|>"), ref.token_to_id("<|endoftext|>")
    meta = pack.tokenizer_meta
    assert (meta["eos_token_ids"], meta["bos_token_id"], meta["pad_token_id"], meta["add_bos_token"]) == (
        [im_end], eot, eot, False)
    assert "<|im_start|>" in meta["chat_template"]
    assert built.decode([im_end, ref.token_to_id("Ġthe")]) == " the"    # control tokens are special


def test_user_defined_tokens_are_whole_and_visible():
    """GGUF USER_DEFINED tokens (<think>) match whole and survive decoding; CONTROL ones are special."""
    from tokenizers import Tokenizer
    from strata.pack.tokenizer_build import CONTROL, NORMAL, USER_DEFINED, gguf_tokenizer
    ref = make_tokenizer(300)
    vocab = {i: t for t, i in ref.get_vocab().items()}
    tokens = [vocab[i] for i in range(300)] + ["<think>"]
    specials = {ref.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    types = [CONTROL if i in specials else NORMAL for i in range(300)] + [USER_DEFINED]
    merges = [" ".join(m) if not isinstance(m, str) else m for m in json.loads(ref.to_str())["model"]["merges"]]
    kv = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges, "tokenizer.ggml.eos_token_id": 299}
    meta, build = gguf_tokenizer(kv, "x.gguf", 301)
    tok = Tokenizer.from_str(build())
    ids = tok.encode("a<think>b<|im_end|>", add_special_tokens=False).ids
    assert ids[1] == 300 and ids[-1] == 299
    assert tok.decode(ids) == "a<think>b"
    assert meta["eos_token_ids"] == [299] and meta["bos_token_id"] is None


def test_rope_scaling_keys(tmp_path):
    keys = {"qwen3moe.rope.scaling.type": "yarn", "qwen3moe.rope.scaling.factor": 4.0,
            "qwen3moe.rope.scaling.original_context_length": 1024}
    paths, _ = make_gguf(tmp_path, SHAPES["tiny"], seed=8, metadata=keys)
    args = open_pack(convert(paths[0], tmp_path / "pack", progress=False)).args
    assert args.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


def test_fim_token_ids_from_gguf_metadata():
    """A GGUF's tokenizer.ggml.fim_pre/suf/mid_token_id become the pack's fim_token_ids (all three or
    none); an id past the vocabulary is dropped as the other ids are."""
    from strata.pack.tokenizer_build import CONTROL, NORMAL, gguf_tokenizer
    ref = make_tokenizer(300)
    vocab = {i: t for t, i in ref.get_vocab().items()}
    merges = [" ".join(m) if not isinstance(m, str) else m for m in json.loads(ref.to_str())["model"]["merges"]]
    kv = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": [vocab[i] for i in range(300)],
          "tokenizer.ggml.token_type": [NORMAL] * 297 + [CONTROL] * 3, "tokenizer.ggml.merges": merges,
          "tokenizer.ggml.eos_token_id": 299, "tokenizer.ggml.fim_pre_token_id": 296,
          "tokenizer.ggml.fim_suf_token_id": 297, "tokenizer.ggml.fim_mid_token_id": 298}
    assert gguf_tokenizer(kv, "x.gguf", 300)[0]["fim_token_ids"] == [296, 297, 298]
    assert "fim_token_ids" not in gguf_tokenizer({**kv, "tokenizer.ggml.fim_mid_token_id": 900}, "x.gguf", 300)[0]
