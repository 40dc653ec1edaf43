"""Reasoning split out of a reply: Qwen3's `<think>...</think>` as `reasoning_content`.

Qwen3 models think first: a reply opens with `<think>`, reasons, closes with `</think>`, then answers.
Clients of OpenAI-style servers (vLLM's qwen3 reasoning parser, llama.cpp's --reasoning-format) get
the thinking as `message.reasoning_content` (streamed as `delta.reasoning_content`) and only the answer
as `content`, so an agent does not read a plan as its answer, nor parse tool calls out of it.

The split applies when the model's vocabulary has both tags (`reasoning_tags`) and the server's
--reasoning-format is auto (its default; none leaves replies as they are). A reply whose first
non-blank text is `<think>` is reasoning up to `</think>`; one whose prompt ended inside an open
`<think>` (thinking templates that open it for the model) is reasoning from its start. Anything else
is content from the start: tags later in an answer stay text. The blank lines after `</think>` are
dropped. A reply cut inside its thinking (max_tokens) is all reasoning.
"""
from __future__ import annotations

from .tools import text_before

OPEN, CLOSE = "<think>", "</think>"


def reasoning_tags(tokenizer) -> bool:
    """Whether the model writes <think> and </think> as tokens of their own (Qwen3's do)."""
    has = getattr(tokenizer, "has_token", None)
    return bool(has and has(OPEN) and has(CLOSE))


def opens_inside(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves the reply inside a <think> it opened."""
    at = prompt_text.rfind(OPEN)
    return at >= 0 and CLOSE not in prompt_text[at:] and not prompt_text[at + len(OPEN):].strip()


class ReasoningReader:
    """push(text) / finish() -> [("reasoning" | "text", str)], the reply split as the module doc says;
    text that might be the start of a tag is held back until it is clear."""

    def __init__(self, inside: bool = False):
        self.state = "inside" if inside else "start"      # start | inside | after | content
        self.buf = ""

    def push(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while self.buf:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(OPEN):
                    self.buf, self.state = stripped[len(OPEN):], "inside"
                elif OPEN.startswith(stripped):
                    return out                       # blank or a piece of <think>: not clear yet
                else:
                    self.state = "content"
            elif self.state == "inside":
                clear, at = text_before(self.buf, CLOSE)
                if clear:
                    out.append(("reasoning", clear))
                self.buf = self.buf[len(clear):]
                if at < 0:
                    return out
                self.buf, self.state = self.buf[len(CLOSE):], "after"
            elif self.state == "after":
                stripped = self.buf.lstrip("\n")
                if not stripped:
                    self.buf = ""
                    return out                       # only newlines so far: they may all be layout
                self.buf, self.state = stripped, "content"
            else:
                out.append(("text", self.buf))
                self.buf = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        rest, self.buf = self.buf, ""
        if not rest:
            return []
        if self.state == "inside":
            return [("reasoning", rest)]
        return [] if self.state == "after" else [("text", rest)]

    @property
    def thinking(self) -> bool:
        return self.state in ("start", "inside")


def split_reasoning(text: str, inside: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a finished reply."""
    reader = ReasoningReader(inside)
    parts = reader.push(text) + reader.finish()
    reasoning = "".join(p for k, p in parts if k == "reasoning")
    saw = inside or any(k == "reasoning" for k, _ in parts) or text.lstrip().startswith(OPEN)
    return (reasoning if saw else None), "".join(p for k, p in parts if k == "text")
