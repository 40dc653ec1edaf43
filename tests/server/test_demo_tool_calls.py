"""The demo model calls tools by itself: with tool_choice "auto" (no grammar) it answers a request that
needs one of the offered functions with a `<tool_call>` whose arguments parse and come from the user's
message, and after the tool's result it answers in plain text. The demo was fine-tuned on such chats
(tools/tool_chats.py, `tools/train_demo.py finetune`; strata/demo/DATA.md). It is a 28M-parameter model:
on held-out prompts it picks the right function about 7 times in 10 and leans to the last one listed, so
these cases list the needed tool where it picks it (greedy, so they are fixed outcomes, not samples)."""
import json

import pytest

jsonschema = pytest.importorskip("jsonschema")


def _tool(name, desc, props, required=None):
    params = {"type": "object", "properties": props, "required": list(required or props)}
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": params}}


WEATHER = _tool("get_weather", "The current weather of a city",
                {"city": {"type": "string", "description": "the city name"},
                 "unit": {"type": "string", "description": "C or F", "enum": ["C", "F"]}})
ADD = _tool("add", "Add two numbers", {"a": {"type": "number", "description": "the first number"},
                                       "b": {"type": "number", "description": "the second number"}})
READ = _tool("read_file", "Read a text file", {"path": {"type": "string", "description": "the file's path"}})
CAPITAL = _tool("get_capital", "The capital city of a country",
                {"country": {"type": "string", "description": "the country"}})
TOOLS = {t["function"]["name"]: t for t in (WEATHER, ADD, READ, CAPITAL)}

# (user message, offered tools, the expected call)
CASES = [
    ("What is the weather in Oslo? Use C.", ["add", "get_weather"], ("get_weather", {"city": "Oslo", "unit": "C"})),
    ("What is 120 plus 33?", ["read_file", "add"], ("add", {"a": 120, "b": 33})),
    ("Read /var/log/app.log for me.", ["read_file", "get_capital"], ("read_file", {"path": "/var/log/app.log"})),
    ("What is the capital of Spain?", ["get_weather", "get_capital"], ("get_capital", {"country": "Spain"})),
]


def _ask(client, llm, messages, names, **kw):
    return client.chat.completions.create(model=llm.model_name, messages=messages, tools=[TOOLS[n] for n in names],
                                          tool_choice="auto", temperature=0, max_tokens=64, **kw).choices[0]


@pytest.mark.parametrize("user,names,expected", CASES, ids=[c[2][0] for c in CASES])
def test_auto_tool_choice_calls_the_offered_tool(demo_client, demo_llm, user, names, expected):
    choice = _ask(demo_client, demo_llm, [{"role": "user", "content": user}], names)
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, TOOLS[call.function.name]["function"]["parameters"])
    assert (call.function.name, args) == expected


def test_tool_result_then_a_final_answer(demo_client, demo_llm):
    messages = [{"role": "user", "content": "What is the weather in Oslo? Use C."}]
    first = _ask(demo_client, demo_llm, messages, ["add", "get_weather"])
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Oslo"
    messages += [first.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id,
                  "content": json.dumps({"city": "Oslo", "temperature": 17, "unit": "C", "conditions": "sunny"})}]
    second = _ask(demo_client, demo_llm, messages, ["add", "get_weather"])
    assert second.finish_reason == "stop" and not second.message.tool_calls
    assert "17" in second.message.content      # it reads the result (its wording is a small model's)


def test_no_call_where_no_tool_is_needed(demo_client, demo_llm):
    choice = _ask(demo_client, demo_llm, [{"role": "user", "content": "Hello!"}], ["get_weather", "add"])
    assert choice.finish_reason == "stop" and not choice.message.tool_calls and choice.message.content
