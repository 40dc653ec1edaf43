"""Tokenizer and chat template of a pack: HF `tokenizers` for text, jinja2 for the template."""
from __future__ import annotations

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
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise PackError(f"{path}: cannot load the tokenizer ({str(e).splitlines()[0]})") from None
        self.bos_token_id = meta.get("bos_token_id")
        self.eos_token_ids = list(meta.get("eos_token_ids") or [])
        self.add_bos = bool(meta.get("add_bos_token")) and self.bos_token_id is not None
        self.chat_template = meta.get("chat_template") or CHATML_TEMPLATE
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._template = None

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise InvalidArgument(f"prompt must be a string, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_token_id, *ids] if self.add_bos else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """Render the model's own chat template over [{role, content}, ...]."""
        if self._template is None:
            self._template = _compile(self.chat_template)
        bos = self.token_text(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.token_text(self.eos_token_ids[0]) if self.eos_token_ids else ""
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=bos or "", eos_token=eos or "", **extra)


def _compile(source: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise InvalidArgument(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise PackError(f"the model's chat template does not compile: {e}") from None
