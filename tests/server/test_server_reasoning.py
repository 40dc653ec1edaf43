"""Qwen3's thinking split out of chat replies (strata.server.reasoning): the reader against every way
the text can be cut, then through the server with a stand-in model whose template opens <think> when
chat_template_kwargs asks (as Qwen3's thinking templates do) and whose replies are scripted."""
import json

import httpx
import numpy as np
import pytest

import strata
from strata.engine.types import Completion, Delta, Usage
from strata.server import create_app
from strata.server.reasoning import ReasoningReader, opens_inside, split_reasoning
from tests.server.helpers import LiveServer


def _parts(text, inside=False, cuts=()):
    reader, parts = ReasoningReader(inside), []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        parts += reader.push(text[a:b])
    parts += reader.finish()
    return ("".join(p for k, p in parts if k == "reasoning"), "".join(p for k, p in parts if k == "text"))


@pytest.mark.parametrize("text,inside,want", [
    ("<think>\nplan it\n</think>\n\nThe answer.", False, ("\nplan it\n", "The answer.")),
    ("  \n<think>a</think>b <think>c</think>", False, ("a", "b <think>c</think>")),
    ("The answer, <think> is a tag here.", False, ("", "The answer, <think> is a tag here.")),
    ("plan</think>\n\nanswer", True, ("plan", "answer")),
    ("<think>cut off before it clo", False, ("cut off before it clo", "")),
    ("<thi", False, ("", "<thi")),
    ("<think>x</think>\n\n", False, ("x", "")),
])
def test_the_reader_however_the_text_is_cut(text, inside, want):
    assert _parts(text, inside) == want
    rng = np.random.default_rng(3)
    for _ in range(40):
        cuts = sorted(int(c) for c in rng.choice(len(text), size=min(len(text) - 1, 5), replace=False) if c)
        assert _parts(text, inside, cuts) == want
    reasoning, content = split_reasoning(text, inside)
    assert content == want[1] and (reasoning or "") == want[0]


def test_opens_inside():
    assert opens_inside("<|im_start|>assistant\n<think>\n") and not opens_inside("<think>\n</think>\n\n")
    assert not opens_inside("<|im_start|>assistant\n") and not opens_inside("<think>x")


class ThinkingTokenizer:
    """The demo's tokenizer, with <think> and </think> as tags, a template that opens <think> for the
    reply when asked (enable_thinking, a chat_template_kwargs variable)."""

    def __init__(self, tok):
        self._t = tok

    def __getattr__(self, name):
        return getattr(self._t, name)

    def has_token(self, text):
        return text in ("<think>", "</think>") or self._t.has_token(text)

    chat_template = "... {% if enable_thinking is defined %} ..."      # reads enable_thinking, as Qwen3's

    def apply_chat_template(self, messages, add_generation_prompt=True, **extra):
        text = self._t.apply_chat_template(messages, add_generation_prompt, **extra)
        if "enable_thinking" not in extra:
            return text
        return text + ("<think>\n" if extra["enable_thinking"] else "<think>\n\n</think>\n\n")


class ScriptedLLM:
    """The demo LLM whose replies are scripted: inside an opened <think> (the prompt ends so) the
    reply continues the thinking, else it opens its own; a tool call follows the answer."""

    def __init__(self, llm):
        self._llm = llm
        self.tokenizer = ThinkingTokenizer(llm.tokenizer)

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def begin(self, ids, params, **kw):
        tail = self.tokenizer.decode(ids[-8:], skip_special_tokens=False).rstrip()
        answer = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
        if tail.endswith("</think>"):               # thinking turned off by the template
            return Scripted(answer, len(ids))
        opened = tail.endswith("<think>")
        return Scripted(("" if opened else "<think>\n") + "I should look up the weather.\n</think>\n\n" + answer,
                        len(ids))


class Scripted:
    pending, yield_chunks = None, False

    def __init__(self, text, prompt_tokens):
        self.pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
        self.completion = None
        self._text, self._n = text, prompt_tokens

    def __iter__(self):
        return self

    def __next__(self):
        if not self.pieces:
            self.completion = Completion(self._text, list(range(40)), "stop", Usage(self._n, 40, 0))
            raise StopIteration
        return Delta(self.pieces.pop(0), 1)

    def cancel(self):
        self.pieces = []


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("opened", [False, True])
@pytest.mark.parametrize("fmt", ["auto", "none"])
def test_reasoning_content_through_the_server(opened, fmt):
    llm = ScriptedLLM(strata.LLM(device="cpu"))
    live = LiveServer(create_app(llm, queue_size=4, warm_up=False, reasoning_format=fmt))
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS,
            **({"chat_template_kwargs": {"enable_thinking": True}} if opened else {})}
    try:
        whole = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=30).json()
        msg = whole["choices"][0]["message"]
        with httpx.stream("POST", live.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
            frames = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        deltas = [c["delta"] for f in frames for c in f["choices"]]
        streamed = "".join(d.get("reasoning_content") or "" for d in deltas)
        text = "".join(d.get("content") or "" for d in deltas)
        calls = [t for d in deltas for t in d.get("tool_calls") or []]
    finally:
        live.close()
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather" and len(calls) == 1
    if fmt == "auto":
        assert msg["reasoning_content"].strip() == "I should look up the weather." == streamed.strip()
        assert msg["content"] == "Let me check. " == text
    else:
        assert "reasoning_content" not in msg and not any("reasoning_content" in d for d in deltas)
        assert msg["content"] == text == ("" if opened else "<think>\n") + ("I should look up the weather.\n"
                                                                           "</think>\n\nLet me check. ")


def test_chat_template_kwargs_are_checked():
    from strata.server.protocol import APIError, template_kwargs
    assert template_kwargs({"chat_template_kwargs": {"enable_thinking": False}}) == {"enable_thinking": False}
    for bad in ([1], {"messages": 1}, {"no space": 1}, {"_x": 1}, {f"k{i}": 1 for i in range(17)}):
        with pytest.raises(APIError) as e:
            template_kwargs({"chat_template_kwargs": bad})
        assert e.value.param == "chat_template_kwargs"


ANTHROPIC_TOOLS = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


@pytest.mark.parametrize("thinking", [None, {"type": "enabled", "budget_tokens": 512}, {"type": "disabled"}])
def test_anthropic_thinking_blocks_and_the_thinking_parameter(thinking):
    """/v1/messages: thinking mapped onto the template's enable_thinking (absent: disabled, Anthropic's
    default), the reply's thinking as a thinking block before the text and the tool use, streamed too."""
    llm = ScriptedLLM(strata.LLM(device="cpu"))
    live = LiveServer(create_app(llm, queue_size=4, warm_up=False))
    body = {"model": llm.model_name, "max_tokens": 64, "tools": ANTHROPIC_TOOLS,
            "messages": [{"role": "user", "content": "Weather in Oslo?"}], **({"thinking": thinking} if thinking else {})}
    try:
        whole = httpx.post(live.url + "/v1/messages", json=body, timeout=30).json()
        with httpx.stream("POST", live.url + "/v1/messages", json={**body, "stream": True}, timeout=30) as r:
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
    finally:
        live.close()
    enabled = bool(thinking) and thinking["type"] == "enabled"
    kinds = [b["type"] for b in whole["content"]]
    assert kinds == (["thinking"] if enabled else []) + ["text", "tool_use"] and whole["stop_reason"] == "tool_use"
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == kinds
    if enabled:
        assert whole["content"][0]["thinking"].strip() == "I should look up the weather."
        streamed = "".join(e["delta"]["thinking"] for e in events if e["type"] == "content_block_delta"
                           and e["delta"]["type"] == "thinking_delta")
        assert streamed == whole["content"][0]["thinking"]
    assert whole["content"][kinds.index("text")]["text"] == "Let me check. "
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == list(range(len(kinds)))


def test_an_assistant_turns_thinking_block_comes_back():
    """Agents return an assistant turn's thinking block beside its tool use: accepted, and left out of
    the prompt (the template reads no earlier thinking)."""
    from strata.server.anthropic import chat_messages
    body = {"messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "look it up", "signature": ""},
                                          {"type": "redacted_thinking", "data": "xx"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 C"}]}]}
    msgs = chat_messages(body)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[1]["content"] == "" and msgs[1]["tool_calls"][0]["function"]["name"] == "get_weather"

