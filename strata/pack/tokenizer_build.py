"""The pack's tokenizer: built from GGUF metadata, or copied from a HF checkpoint.

Both return (meta, json_fn): meta is the pack.json "tokenizer" entry (less "file"), json_fn() the HF
`tokenizers` serialization to store as tokenizer.json (built only when a pack is written).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from ..errors import FormatError, PackError, UnsupportedError

# GGUF token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split regexes by tokenizer.ggml.pre (the patterns the models were trained with).
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"qwen2": QWEN2_REGEX, "llama-bpe": LLAMA3_REGEX, "llama3": LLAMA3_REGEX,
                  "gpt-2": None, "gpt2": None, "default": None}   # None: GPT-2's own byte-level regex


def _strings(kv: dict, key: str, path: Path) -> list[str]:
    v = kv[key]
    if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
        raise FormatError(f"{path}: metadata key {key} is not an array of strings")
    bad = next((i for i, t in enumerate(v) if not _utf8(t)), None)
    if bad is not None:
        raise FormatError(f"{path}: metadata key {key}: item {bad} is not valid UTF-8")
    return v


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")       # the reader keeps bad bytes as surrogates; tokenizers and JSON cannot
        return True
    except UnicodeEncodeError:
        return False


def chat_template_problem(template) -> str | None:
    """Why a chat template cannot be used (not a string, not UTF-8, does not compile), or None."""
    if template is None:
        return None
    if not isinstance(template, str):
        return f"the chat template is a {type(template).__name__}, not a string"
    if not _utf8(template):
        return "the chat template is not valid UTF-8"
    from ..tokenizer import compile_chat_template
    try:
        compile_chat_template(template)
    except PackError as e:
        return str(e)
    return None


def gguf_tokenizer(kv: dict, path: Path, vocab_size: int) -> tuple[dict, Callable[[], str]]:
    """Tokenizer meta and builder from GGUF `tokenizer.*` metadata (BPE "gpt2" models only)."""
    model = kv.get("tokenizer.ggml.model")
    if model is None:
        raise FormatError(f"{path}: missing metadata key tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedError(f"{path}: tokenizer model {str(model)[:80]!r} is not supported (supported: gpt2)")
    pre = kv.get("tokenizer.ggml.pre", "default")
    if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
        raise UnsupportedError(f"{path}: pre-tokenizer {str(pre)[:80]!r} is not supported "
                               f"(supported: {', '.join(PRE_TOKENIZERS)})")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if key not in kv:
            raise FormatError(f"{path}: missing metadata key {key}")
    tokens, merges = _strings(kv, "tokenizer.ggml.tokens", path), _strings(kv, "tokenizer.ggml.merges", path)
    if len(tokens) > vocab_size:
        raise FormatError(f"{path}: {len(tokens)} tokens but token_embd.weight has only {vocab_size} rows")
    types = kv.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if (not isinstance(types, list) or len(types) != len(tokens)
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in types)):
        raise FormatError(f"{path}: metadata key tokenizer.ggml.token_type is not one integer per token")

    def token_id(key: str) -> int | None:
        v = kv.get(f"tokenizer.ggml.{key}")
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise FormatError(f"{path}: metadata key tokenizer.ggml.{key} = {v!r:.80} is not an integer")
        return v if v is not None and 0 <= v < len(tokens) else None

    add_bos = kv.get("tokenizer.ggml.add_bos_token", False)
    if not isinstance(add_bos, (bool, int)):
        raise FormatError(f"{path}: metadata key tokenizer.ggml.add_bos_token = {add_bos!r:.80} is not a boolean")
    template = kv.get("tokenizer.chat_template")
    problem = chat_template_problem(template)
    if problem:
        raise FormatError(f"{path}: metadata key tokenizer.chat_template: {problem}")
    eos = [i for i in (token_id("eos_token_id"), token_id("eot_token_id"), token_id("eom_token_id")) if i is not None]
    meta = {"bos_token_id": token_id("bos_token_id"), "eos_token_ids": list(dict.fromkeys(eos)),
            "pad_token_id": token_id("padding_token_id"), "add_bos_token": bool(add_bos),
            "chat_template": template}
    fim = [token_id(f"fim_{k}_token_id") for k in ("pre", "suf", "mid")]     # fill-in-the-middle, where named
    if None not in fim:
        meta["fim_token_ids"] = fim
    return meta, lambda: _bpe_json(path, tokens, types, merges, pre)


def _bpe_json(path: Path, tokens: list[str], types: list[int], merges: list[str], pre: str) -> str:
    try:
        return _build_bpe(path, tokens, types, merges, pre)
    except FormatError:
        raise
    except BaseException as e:
        # tokenizers raises a bare Exception for merges naming unknown tokens, and its Rust panics
        # arrive as pyo3's PanicException, a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise FormatError(f"{path}: the tokenizer does not build ({first})") from None


def _build_bpe(path: Path, tokens: list[str], types: list[int], merges: list[str], pre: str) -> str:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    vocab = {}
    for i, t in enumerate(tokens):
        # a repeated string would shadow an id; give the repeat a unique unreachable name
        vocab[t if t not in vocab else f"[DUPLICATE{i}]"] = i
    pairs = []
    for m in merges:
        pair = m.split(" ")
        if len(pair) != 2:
            raise FormatError(f"{path}: malformed merge {m[:80]!r} in tokenizer.ggml.merges")
        pairs.append((pair[0], pair[1]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    regex = PRE_TOKENIZERS[pre]
    if regex is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens are special (never produced from text, skipped when decoding); user-defined
    # ones (<think>, <tool_call>) are matched whole but stay visible in decoded text, as in HF.
    added = [AddedToken(t, special=(ty == CONTROL), normalized=False)
             for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)]
    tok.add_tokens([a for a in added if not a.special])
    tok.add_special_tokens([a for a in added if a.special])
    return tok.to_str()


def _read_json(path: Path, required: bool = False) -> dict:
    if not path.is_file():
        if required:
            raise FormatError(f"{path.parent}: missing {path.name}")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: not valid JSON ({e})") from None


def _ids(v) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]


def hf_tokenizer(src: Path, config: dict) -> tuple[dict, Callable[[], str]]:
    """Tokenizer meta from tokenizer_config.json (+ eos from config.json / generation_config.json)."""
    from tokenizers import Tokenizer
    tok_path = src / "tokenizer.json"
    if not tok_path.is_file():
        raise FormatError(f"{src}: missing tokenizer.json")
    text = tok_path.read_text(encoding="utf-8")
    try:
        tok = Tokenizer.from_str(text)
    except BaseException as e:  # a bare Exception on a bad file; a PanicException (BaseException) on worse
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise FormatError(f"{tok_path}: cannot load the tokenizer ({first})") from None
    tc = _read_json(src / "tokenizer_config.json")
    gen = _read_json(src / "generation_config.json")

    def token_id(v) -> int | None:
        if isinstance(v, dict):
            v = v.get("content")
        return tok.token_to_id(v) if isinstance(v, str) else None

    template = tc.get("chat_template")
    if isinstance(template, list):      # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (src / "chat_template.jinja").is_file():
        template = (src / "chat_template.jinja").read_text(encoding="utf-8")
    problem = chat_template_problem(template)
    if problem:
        raise FormatError(f"{src}: {problem}")
    eos = [token_id(tc.get("eos_token"))] + _ids(config.get("eos_token_id")) + _ids(gen.get("eos_token_id"))
    pad = token_id(tc.get("pad_token"))
    meta = {"bos_token_id": token_id(tc.get("bos_token")),
            "eos_token_ids": list(dict.fromkeys(i for i in eos if i is not None)),
            "pad_token_id": pad if pad is not None else (_ids(config.get("pad_token_id")) or [None])[0],
            "add_bos_token": bool(tc.get("add_bos_token", False)), "chat_template": template}
    return meta, lambda: text
