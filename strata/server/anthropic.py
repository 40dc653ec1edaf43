"""Anthropic's Messages API (POST /v1/messages): request checking, reply bodies and stream events.

A request becomes the same chat messages the OpenAI route makes (text blocks joined; tool_use blocks
an assistant's tool_calls; tool_result blocks tool messages), so both routes share the template,
the tool rendering and the grammar. Errors have Anthropic's shape {"type": "error", "error": {type,
message}}; the app picks it for every answer under /v1/messages.
"""
from __future__ import annotations

import json
import uuid
from typing import Callable

from .protocol import MAX_STOP_STRINGS, APIError, _boolean, _integer, _number, invalid, unsupported
from .tools import MAX_TOOLS, ToolCallReader, ToolSpec, function_def

ROUTE = "/v1/messages"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _text_blocks(content, where: str, allowed: tuple[str, ...] = ("text",)) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise invalid(where, f"{where} must be a string or a list of content blocks", "invalid_type")
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise invalid(f"{where}[{j}]", f"{where}[{j}] must be a content block with a type", "invalid_type")
        if b["type"] not in allowed:
            raise unsupported(f"{where}[{j}].type", f"a {b['type'][:40]!r} block here")
        if b["type"] == "text" and not isinstance(b.get("text"), str):
            raise invalid(f"{where}[{j}].text", f"{where}[{j}].text must be a string", "invalid_type")
    return content


def _system(body: dict) -> list[dict]:
    s = body.get("system")
    if s is None:
        return []
    text = "".join(b["text"] for b in _text_blocks(s, "system"))
    return [{"role": "system", "content": text}] if text else []


def _tool_result_text(b: dict, where: str) -> str:
    content = b.get("content", "")
    text = "".join(x["text"] for x in _text_blocks(content, f"{where}.content"))
    return f"Error: {text}" if b.get("is_error") is True else text


def chat_messages(body: dict) -> list[dict]:
    """messages (and system) -> the chat messages of strata.server.protocol.chat_messages."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages", "messages must be a non-empty list of message objects", "invalid_type")
    out = _system(body)
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise invalid(f"{where}.role", f"{where}.role must be user or assistant")
        # an assistant turn's thinking blocks come back with it (agents must return them beside a tool
        # use); the template reads no earlier thinking, so they are dropped
        kinds = ("text", "tool_result") if m["role"] == "user" else ("text", "tool_use", "thinking",
                                                                      "redacted_thinking")
        blocks = _text_blocks(m.get("content"), f"{where}.content", kinds)
        text, calls = [], []
        for j, b in enumerate(blocks):
            at = f"{where}.content[{j}]"
            if b["type"] in ("thinking", "redacted_thinking"):
                continue
            if b["type"] == "text":
                text.append(b["text"])
            elif b["type"] == "tool_use":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise invalid(at, f"{at} must have a name (string) and an input (object)", "invalid_type")
                calls.append({"id": str(b.get("id", "")), "type": "function",
                              "function": {"name": b["name"], "arguments": b.get("input", {})}})
            else:
                if text:        # text before a result stays before it
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                out.append({"role": "tool", "content": _tool_result_text(b, at),
                            "tool_call_id": str(b.get("tool_use_id", ""))})
        if m["role"] == "assistant":
            out.append({"role": "assistant", "content": "".join(text), **({"tool_calls": calls} if calls else {})})
        elif text or not blocks:
            out.append({"role": "user", "content": "".join(text)})
    return out


def tools(body: dict) -> ToolSpec:
    """tools [{name, description, input_schema}] and tool_choice {type: auto|any|tool|none} -> ToolSpec."""
    raw = body.get("tools") or []
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise invalid("tools", f"tools must be a list of at most {MAX_TOOLS} tools", "invalid_type")
    fs, names = [], set()
    for i, t in enumerate(raw):
        if not isinstance(t, dict):
            raise invalid(f"tools[{i}]", f"tools[{i}] must be an object", "invalid_type")
        if t.get("type") not in (None, "custom"):
            raise unsupported(f"tools[{i}].type", f"the server tool {str(t.get('type'))[:40]!r}")
        f = function_def({"name": t.get("name"), "description": t.get("description", ""),
                          "parameters": t.get("input_schema", {"type": "object"})}, f"tools[{i}]")
        if f["name"] in names:
            raise invalid(f"tools[{i}].name", f"tools[{i}].name {f['name']!r} is given twice")
        names.add(f["name"])
        fs.append({"type": "function", "function": f})
    choice = body.get("tool_choice") or {"type": "auto"}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise invalid("tool_choice", "tool_choice.type must be auto, any, tool or none")
    if kind == "tool":
        if choice.get("name") not in names:
            raise invalid("tool_choice.name", "tool_choice.name must name one of the tools")
        return ToolSpec(tuple(fs), choice["name"], named=True)
    if kind == "any" and not fs:
        raise invalid("tool_choice", "tool_choice any needs tools")
    return ToolSpec(tuple(fs), {"auto": "auto", "any": "required", "none": "none"}[kind] if fs else "none")


def sampling(body: dict, max_context: int) -> tuple[int, dict]:
    """(max_tokens, SamplingParams fields but max_tokens)."""
    if body.get("max_tokens") is None:
        raise invalid("max_tokens", "max_tokens is required", "missing_required_parameter")
    # a ceiling, clamped to the context's room: agents send their own large default whatever the model
    max_tokens = min(_integer(body, "max_tokens", lo=1), max_context)
    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list) or any(not isinstance(s, str) or not s for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise invalid("stop_sequences", f"stop_sequences must be a list of at most {MAX_STOP_STRINGS} "
                                        f"non-empty strings")
    temperature = _number(body, "temperature", 1.0, 0.0, 1.0)      # Anthropic's range and default
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        temperature, top_p = 0.0, 1.0
    top_k = _integer(body, "top_k", lo=0) or 0
    _boolean(body, "stream")
    return max_tokens, {"temperature": temperature, "top_p": top_p, "top_k": top_k, "stop": tuple(stop), "seed": None}


def thinking(body: dict, template_source: str) -> dict:
    """The template variables of Anthropic's `thinking` ({"type": "enabled", "budget_tokens": N} or
    {"type": "disabled"}; absent: disabled, as Anthropic's default): enable_thinking, where the model's
    chat template reads it (Qwen3's does); else none. budget_tokens is checked, not enforced."""
    v = body.get("thinking")
    if v is not None:
        if not isinstance(v, dict) or v.get("type") not in ("enabled", "disabled"):
            raise invalid("thinking", 'thinking must be {"type": "enabled", "budget_tokens": N} or '
                                      '{"type": "disabled"}', "invalid_type")
        if v["type"] == "enabled":
            _integer(v, "budget_tokens", lo=1)
    if "enable_thinking" not in (template_source or ""):
        return {}
    return {"enable_thinking": bool(v) and v["type"] == "enabled"}


def check_model(body: dict, model_name: str) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        raise invalid("model", "model is required (a string)", "missing_required_parameter")
    if model != model_name:
        raise APIError(404, f"model: {model!r} does not exist; this server serves {model_name!r}", param="model",
                       code="model_not_found")


# ---- replies ----

def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def tool_use_block(call: dict) -> dict:
    try:
        args = json.loads(call["arguments"])
    except ValueError:
        args = {"arguments": call["arguments"]}
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["name"],
            "input": args if isinstance(args, dict) else {"value": args}}


def stop_reason(completion, stops: tuple[str, ...], full_text: str, num_calls: int) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): which stop string ended the text, read from the decoded tokens."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if num_calls:
        return "tool_use", None
    if completion.finish_reason == "stop":
        hit = [s for s in stops if full_text.startswith(s, len(completion.text))]
        if hit:
            return "stop_sequence", hit[0]
    return "end_turn", None


def usage(completion) -> dict:
    u = completion.usage
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def message_body(msg_id: str, model: str, completion, parts: list, reason: tuple[str, str | None]) -> dict:
    """parts: ("thinking", text) (strata.server.reasoning's split), ("text", text) and ("call", call)."""
    content = []
    for kind, p in parts:
        if kind == "thinking":
            content.append({"type": "thinking", "thinking": p, "signature": ""})
        elif kind == "text":
            if p:
                content.append({"type": "text", "text": p})
        else:
            content.append(tool_use_block(p))
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason[0], "stop_sequence": reason[1], "usage": usage(completion)}


def _event(name: str, data: dict) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


class EventWriter:
    """The SSE events of one streamed message: message_start, then per block content_block_start,
    its deltas and content_block_stop, then message_delta (stop reason, usage) and message_stop.
    stop_reason(completion, num_calls) -> (stop_reason, stop_sequence) (see stop_reason())."""

    def __init__(self, msg_id: str, model: str, tools, input_tokens: int,
                 stop_reason: Callable[[object, int], tuple[str, str | None]], thinking=None):
        """tools: the request's active ToolSpec (its calls are read out of the text), or None.
        thinking: a strata.server.reasoning.ReasoningReader (the reply's thinking as a thinking block)."""
        self.msg_id, self.model, self.input_tokens, self.stop_reason = msg_id, model, input_tokens, stop_reason
        self.reader = ToolCallReader(tools) if tools else None
        self.thinking = thinking
        self.index, self.open = 0, None         # the open block's kind: text, thinking or None

    def start(self) -> bytes:
        msg = {"id": self.msg_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}
        return _event("message_start", {"type": "message_start", "message": msg}) + _event("ping", {"type": "ping"})

    def delta(self, text: str | None) -> bytes:
        """Events for a text delta (None: the end of the text)."""
        if self.thinking is None:
            return self._answer(text)
        out = b""
        for kind, p in (self.thinking.push(text) if text is not None else self.thinking.finish()):
            if kind == "reasoning":
                out += self._streamed("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                                      {"type": "thinking_delta", "thinking": p})
            else:
                out += self._close("thinking") + self._answer(p)
        if text is None or not self.thinking.thinking:
            out += self._close("thinking")
        return out + (self._answer(None) if text is None else b"")

    def _answer(self, text: str | None) -> bytes:
        if self.reader is None:
            parts = [("text", text)] if text else []
        else:
            parts = self.reader.push(text) if text is not None else self.reader.finish()
        out = b""
        for kind, p in parts:
            if kind == "text" and p:
                out += self._streamed("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": p})
            elif kind == "call":
                out += self._close()
                block = tool_use_block(p)
                out += _event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                      "content_block": {**block, "input": {}}})
                out += _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
                out += _event("content_block_stop", {"type": "content_block_stop", "index": self.index})
                self.index += 1
        return out

    def _streamed(self, kind: str, block: dict, delta: dict) -> bytes:
        """A delta of the open block of this kind, the block started first where none of it is open."""
        out = b""
        if self.open != kind:
            out += self._close() + _event("content_block_start", {"type": "content_block_start",
                                                                  "index": self.index, "content_block": block})
            self.open = kind
        return out + _event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                    "delta": delta})

    def _close(self, kind: str | None = None) -> bytes:
        """The open block's stop (only where it is of `kind`, if given)."""
        if self.open is None or kind not in (None, self.open):
            return b""
        self.open = None
        self.index += 1
        return _event("content_block_stop", {"type": "content_block_stop", "index": self.index - 1})

    @property
    def num_calls(self) -> int:
        return self.reader.num_calls if self.reader else 0

    def finish(self, completion) -> bytes:
        reason = self.stop_reason(completion, self.num_calls)
        out = self.delta(None) + self._close()
        out += _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason[0],
                                                                           "stop_sequence": reason[1]},
                                        "usage": usage(completion)})
        return out + _event("message_stop", {"type": "message_stop"})

    @staticmethod
    def error(err: APIError) -> bytes:
        return _event("error", error_body(err.status, err.message))
