"""Tool calls: the reader that splits calls out of streamed text, Strata's rendering for templates
without a tools section, and an openai-client round trip on the demo model."""
import json

import numpy as np
import pytest

from strata.server.tools import (TOOLS_PREAMBLE, ToolCallReader, ToolSpec, parse_tools, render_messages, split_calls,
                                 template_reads_tools)

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"]}}}


def reader_parts(chunks):
    reader, parts = ToolCallReader(), []
    for c in chunks:
        parts += reader.push(c)
    parts += reader.finish()
    text = "".join(p for k, p in parts if k == "text")
    return text, [(p["name"], json.loads(p["arguments"])) for k, p in parts if k == "call"]


def test_reader_gives_the_same_calls_however_the_text_is_cut():
    reply = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n'
             '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call> done <tool')
    whole = reader_parts([reply])
    assert whole == ("Let me look. \n done <tool", [("get_weather", {"city": "Oslo", "unit": "C"}),
                                                  ("get_time", {"zone": "CET"})])
    rng = np.random.default_rng()
    for _ in range(50):
        cuts = sorted(rng.choice(len(reply), size=int(rng.integers(1, 12)), replace=False))
        chunks = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
        assert reader_parts(chunks) == whole


def test_reader_keeps_what_is_not_a_call_as_text():
    for text in ("a < b and <tool_cal is not a tag", "<tool_call>not json</tool_call>",
                 '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>{\"name\": \"f\""):
        assert reader_parts([text]) == (text, [])
    assert split_calls('<tool_call>{"name": "f", "arguments": "raw"}</tool_call>')[1][0]["arguments"] == "raw"


RUN = {"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
    "cmd": {"type": "string"}, "timeout": {"type": "integer"}, "shell": {"type": "boolean"},
    "env": {"type": "object"}, "args": {"type": "array"}, "note": {}}}}}


def test_qwen3_coder_xml_calls_are_read_back_typed_by_their_schema():
    """Qwen3-Coder writes <function=...> and <parameter=...> tags inside <tool_call>: values typed by
    the parameters' schemas (a string stays text, even when it looks like JSON), streamed or whole."""
    spec = parse_tools({"tools": [RUN, TIME]})
    reply = ("I will run it.\n<tool_call>\n<function=run>\n<parameter=cmd>\npytest -q tests/\n</parameter>\n"
             "<parameter=timeout>\n30\n</parameter>\n<parameter=shell>\ntrue\n</parameter>\n"
             "<parameter=env>\n{\"CI\": \"1\"}\n</parameter>\n<parameter=args>\n[1, 2]\n</parameter>\n"
             "<parameter=note>\n42\n</parameter>\n</function>\n</tool_call>\n"
             "<tool_call>\n<function=get_time>\n<parameter=zone>\n123\n</parameter>\n</function>\n</tool_call>")
    content, calls = split_calls(reply, spec)
    assert content.strip() == "I will run it."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("run", {"cmd": "pytest -q tests/", "timeout": 30, "shell": True, "env": {"CI": "1"}, "args": [1, 2],
                 "note": "42"}),
        ("get_time", {"zone": "123"})]
    reader, parts = ToolCallReader(spec), []
    for i in range(0, len(reply), 7):
        parts += reader.push(reply[i:i + 7])
    parts += reader.finish()
    assert [json.loads(p["arguments"]) for k, p in parts if k == "call"] == [json.loads(c["arguments"]) for c in calls]
    for bad in ("<tool_call><function=run>stray text<parameter=cmd>x</parameter></function></tool_call>",
                "<tool_call><function=run><parameter=cmd>x</parameter></tool_call>"):
        assert split_calls(bad, spec) == (bad, [])


def test_rendering_for_a_template_without_tools():
    chatml = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    assert not template_reads_tools(chatml)
    spec = parse_tools({"tools": [WEATHER]})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "content": "21", "tool_call_id": "c1"}, {"role": "tool", "content": "22"}]
    out, extra = render_messages(messages, spec, chatml)
    assert extra == {} and [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER) in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\n21\n</tool_response>\n<tool_response>\n22\n</tool_response>"
    none, _ = render_messages(messages[1:2], parse_tools({"tools": [WEATHER], "tool_choice": "none"}), chatml)
    assert none == messages[1:2]
    assert TOOLS_PREAMBLE.split("{tools}")[0] in render_messages(messages[1:2], spec, chatml)[0][0]["content"]


def test_a_template_with_tools_gets_them_itself():
    source = "{% if tools %}{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% endif %}{{ messages[0].content }}"
    assert template_reads_tools(source)
    msgs = [{"role": "user", "content": "hi"}]
    assert render_messages(msgs, parse_tools({"tools": [WEATHER, TIME]}), source) == (msgs, {"tools": [WEATHER, TIME]})
    named = {"type": "function", "function": {"name": "get_time"}}
    spec = parse_tools({"tools": [WEATHER, TIME], "tool_choice": named})
    assert spec == ToolSpec((WEATHER, TIME), "get_time", named=True) and spec.forced
    assert [f["name"] for f in spec.functions()] == ["get_time"]


def test_openai_tool_round_trip_on_the_demo_model(demo_client, demo_llm):
    """tool_choice required: the grammar makes even the small demo model answer with a valid call;
    the result goes back as a tool message and the next turn reads it."""
    messages = [{"role": "user", "content": "What is the weather in Paris, in Celsius?"}]
    first = demo_client.chat.completions.create(model=demo_llm.model_name, messages=messages, tools=[WEATHER, TIME],
                                                tool_choice="required", temperature=0.7, seed=11, max_tokens=80)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert call.id.startswith("call_") and call.type == "function"
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    second = demo_client.chat.completions.create(model=demo_llm.model_name, messages=messages, tools=[WEATHER, TIME],
                                                 temperature=0, max_tokens=16)
    assert second.choices[0].finish_reason in ("stop", "length")
    rendered, _ = render_messages([{"role": "user", "content": messages[0]["content"]},
                                   {"role": "assistant", "content": "", "tool_calls": [{"function": {
                                       "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
                                   {"role": "tool", "content": messages[2]["content"]}],
                                  parse_tools({"tools": [WEATHER, TIME]}), demo_llm.tokenizer.chat_template)
    prompt = demo_llm.tokenizer.apply_chat_template(rendered, add_generation_prompt=True)
    assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in prompt
    assert second.usage.prompt_tokens == len(demo_llm.tokenizer.encode(prompt))


def test_named_tool_choice_streams_one_call_as_deltas(demo_client, demo_llm):
    kw = dict(model=demo_llm.model_name, messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
              tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
              temperature=0, max_tokens=60)
    full = demo_client.chat.completions.create(**kw).choices[0]
    (call,) = full.message.tool_calls
    assert call.function.name == "get_time" and full.finish_reason == "tool_calls"
    calls, finish, content = {}, None, ""
    for chunk in demo_client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and content == ""
    assert calls == {0: {"name": "get_time", "arguments": call.function.arguments}}
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
