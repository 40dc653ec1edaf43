"""Tokenizer and chat template of a pack: HF `tokenizers` for text, jinja2 for the template."""
from __future__ import annotations

import functools
from pathlib import Path

from .errors import InvalidArgument, PackError

# Used only when the model ships no template of its own.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Tokenizer:
    def __init__(self, path: Path, meta: dict):
        from tokenizers import Tokenizer as HFTokenizer
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except BaseException as e:  # a bare Exception on a bad file; a PanicException (BaseException) on worse
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            first = (str(e).splitlines() or [type(e).__name__])[0][:200]
            raise PackError(f"{path}: cannot load the tokenizer ({first})") from None
        self.bos_token_id = meta.get("bos_token_id")
        self.eos_token_ids = list(meta.get("eos_token_ids") or [])
        self.add_bos = bool(meta.get("add_bos_token")) and self.bos_token_id is not None
        self.chat_template = meta.get("chat_template") or CHATML_TEMPLATE
        if not isinstance(self.chat_template, str):
            raise PackError(f"{path}: the chat template is a {type(self.chat_template).__name__}, not a string")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._meta_fim = meta.get("fim_token_ids")
        self._template = compile_chat_template(self.chat_template)    # at load, not at the first chat

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """The ids of text, after the BOS token where the model adds one (and `bos`)."""
        if not isinstance(text, str):
            raise InvalidArgument(f"prompt must be a string, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if self.add_bos and bos else ids

    # fill-in-the-middle tokens by name, for packs whose metadata does not name them (Qwen2.5/3-Coder's,
    # StarCoder's): prefix, suffix, middle
    FIM_NAMES = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))

    @functools.cached_property
    def fim_token_ids(self) -> tuple[int, int, int] | None:
        """(prefix, suffix, middle) token ids of the model's fill-in-the-middle format, or None: the
        pack's tokenizer.fim_token_ids (a GGUF's fim_pre/suf/mid), else the known names in the vocabulary."""
        if self._meta_fim:
            return tuple(self._meta_fim)
        for names in self.FIM_NAMES:
            ids = [self._tok.token_to_id(n) for n in names]
            if None not in ids:
                return tuple(ids)
        return None

    def fill_in_the_middle(self, prefix: str | list[int], suffix: str) -> list[int]:
        """A fill-in-the-middle prompt, prefix-suffix-middle order (BOS first where the model adds
        one); prefix as text or ids. InvalidArgument where the model has no such tokens."""
        fim = self.fim_token_ids
        if fim is None:
            raise InvalidArgument("this model has no fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, "
                                  "<|fim_middle|>, or a GGUF's tokenizer.ggml.fim_*_token_id)")
        head = [self.bos_token_id] if self.add_bos else []
        body = self.encode(prefix, bos=False) if isinstance(prefix, str) else list(prefix)
        if head and body[:1] == head:
            body = body[1:]
        return [*head, fim[0], *body, fim[1], *self.encode(suffix, bos=False), fim[2]]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as HF tokenizer.json text (what llguidance builds its token masks from)."""
        return self._tok.to_str()

    def token_text(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def has_token(self, text: str) -> bool:
        """Whether text is one token of the vocabulary (an added token such as <think>, or a piece)."""
        return self._tok.token_to_id(text) is not None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token_id stands for (a byte-level BPE piece may hold part of a UTF-8
        character): an added token's text, a ByteLevel piece through the byte alphabet's inverse,
        else the token decoded alone."""
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            return b""
        if int(token_id) in self._added or self._byte_of is None:
            return piece.encode() if int(token_id) in self._added else \
                self.decode([token_id], skip_special_tokens=False).encode()
        try:
            return bytes(self._byte_of[c] for c in piece)
        except KeyError:        # not a byte-alphabet piece after all
            return self.decode([token_id], skip_special_tokens=False).encode()

    @functools.cached_property
    def _added(self) -> frozenset:
        return frozenset(self._tok.get_added_tokens_decoder())

    @functools.cached_property
    def _byte_of(self) -> dict | None:
        """ByteLevel's alphabet inverted (character -> byte), or None where the decoder is another."""
        import json
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or ()}
        return byte_alphabet() if "ByteLevel" in kinds else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """Render the model's own chat template over [{role, content}, ...]."""
        bos = self.token_text(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.token_text(self.eos_token_ids[0]) if self.eos_token_ids else ""
        return render_chat_template(self._template, messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=bos or "", eos_token=eos or "", **extra)


def byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte, inverted: the bytes that print as one
    visible Latin-1 character (33-126, 161-172, 174-255) stand for themselves, and the other 68
    take the characters from U+0100 on, in byte order."""
    visible = [*range(33, 127), *range(161, 173), *range(174, 256)]
    rest = [b for b in range(256) if b not in set(visible)]
    out = {chr(b): b for b in visible}
    out.update({chr(256 + n): b for n, b in enumerate(rest)})
    return out


def render_chat_template(template, messages: list[dict], **variables) -> str:
    """template.render() under a step, time and size budget (strata/chat_template.py: the template is
    the model's code); InvalidArgument (one line) when it fails on these messages or runs past the budget."""
    from .chat_template import render
    return render(template, messages=messages, **variables)


@functools.lru_cache(maxsize=16)       # a Template is immutable; one compile (~20 ms) per distinct source
def compile_chat_template(source: str):
    """The jinja2 template (sandboxed, HF's whitespace rules); PackError if it does not compile or
    fails on a one-message chat."""
    from .chat_template import compile_template
    try:
        template = compile_template(source)
    except Exception as e:  # a TemplateError, or RecursionError from a template nested past Python's stack
        raise PackError(f"the model's chat template does not compile: {str(e)[:200]}") from None
    # one plain user turn must render: a template that fails on it fails on every chat
    try:
        render_chat_template(template, [{"role": "user", "content": "hello"}], add_generation_prompt=True,
                             bos_token="", eos_token="")
    except InvalidArgument as e:
        why = str(e).removeprefix("chat template: ").removeprefix("fails on these messages ")
        raise PackError(f"the model's chat template fails on a one-message chat: {why}") from None
    return template
