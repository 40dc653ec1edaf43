"""POST /v1/messages with the official anthropic client against the live server: a chat, a stream,
stop sequences, a tool use round trip on the demo model, and Anthropic-shaped errors. (This client
version has no temperature argument; it goes in extra_body, which the server reads.)"""

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"name": "get_weather", "description": "The current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                            "required": ["city"]}}


def client_for(url: str, key: str = "unused"):
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


@pytest.fixture
def aclient(demo_server):
    return client_for(demo_server.url)


def test_chat_and_stream_agree(aclient, demo_llm):
    kw = dict(model=demo_llm.model_name, max_tokens=16, extra_body={"temperature": 0},
              system="You are a helpful assistant.",
              messages=[{"role": "user", "content": [{"type": "text", "text": "What does `os.path.join` do?"}]}])
    msg = aclient.messages.create(**kw)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == demo_llm.model_name
    assert msg.id.startswith("msg_") and [b.type for b in msg.content] == ["text"]
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.usage.output_tokens <= 16
    prompt = demo_llm.tokenizer.apply_chat_template(
        [{"role": "system", "content": kw["system"]}, {"role": "user", "content": "What does `os.path.join` do?"}])
    n_prompt = len(demo_llm.tokenizer.encode(prompt))
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == n_prompt
    counted = aclient.messages.count_tokens(model=kw["model"], system=kw["system"], messages=kw["messages"])
    assert counted.input_tokens == n_prompt

    events = []
    with aclient.messages.stream(**kw) as stream:
        for event in stream:
            events.append(event.type)
        final = stream.get_final_message()
    assert final.content[0].text == msg.content[0].text and final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(events)


def test_stop_sequence_is_reported(aclient, demo_llm):
    kw = dict(model=demo_llm.model_name, max_tokens=24, extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "What does `json.dumps` do?"}])
    text = aclient.messages.create(**kw).content[0].text
    stop = next((text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].strip() == text[i:i + 2]
                 and text[i:i + 2].isprintable()), None)
    assert stop, text
    msg = aclient.messages.create(stop_sequences=[stop, "\x00never"], **kw)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[:text.index(stop)]


def test_tool_use_round_trip(aclient, demo_llm):
    messages = [{"role": "user", "content": "What is the weather in Rome?"}]
    msg = aclient.messages.create(model=demo_llm.model_name, max_tokens=80, extra_body={"temperature": 0.7},
                                  tools=[WEATHER], tool_choice={"type": "any"}, messages=messages)
    assert msg.stop_reason == "tool_use"
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": "18 C, sunny"}]}]
    reply = aclient.messages.create(model=demo_llm.model_name, max_tokens=12, extra_body={"temperature": 0},
                                    tools=[WEATHER], messages=messages)
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")

    with aclient.messages.stream(model=demo_llm.model_name, max_tokens=80, extra_body={"temperature": 0},
                                 tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
                                 messages=messages[:1]) as s:
        final = s.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and streamed.name == "get_weather"
    jsonschema.validate(streamed.input, WEATHER["input_schema"])


def test_errors_have_anthropics_shape(aclient, demo_server, demo_llm):
    with pytest.raises(anthropic.BadRequestError) as e:
        aclient.messages.create(model=demo_llm.model_name, max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        aclient.messages.create(model="claude-nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(demo_server.url + "/v1/messages", json={"model": demo_llm.model_name, "max_tokens": 5,
                                                          "messages": [{"role": "user", "content": [
                                                              {"type": "image", "source": {}}]}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(demo_server.url + "/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_api_key_by_x_api_key_and_bearer(demo_llm):
    from strata.server import create_app
    from tests.server.helpers import LiveServer
    live = LiveServer(create_app(demo_llm, api_key="sekrit", warm_up=False, allowed_hosts=["127.0.0.1"]))
    try:
        body = dict(model=demo_llm.model_name, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert client_for(live.url, "sekrit").messages.create(**body).usage.output_tokens <= 2   # sends x-api-key
        with pytest.raises(anthropic.AuthenticationError) as e:
            client_for(live.url, "wrong").messages.create(**body)
        assert e.value.body["error"]["type"] == "authentication_error"
        r = httpx.post(live.url + "/v1/messages", json=body, headers={"authorization": "Bearer sekrit"})
        assert r.status_code == 200, r.text
        r = httpx.post(live.url + "/v1/messages", json=body, headers={"x-api-key": "sekrit", "host": "evil.example"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert "evil.example" in r.json()["error"]["message"]
    finally:
        live.close()


def test_blocks_become_the_chat_messages_of_the_openai_route():
    from strata.server.anthropic import chat_messages, tools
    body = {"system": [{"type": "text", "text": "Be brief."}], "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Rome"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                                     {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                      "content": [{"type": "text", "text": "timeout"}]},
                                     {"type": "text", "text": "Thanks"}]}]}
    assert chat_messages(body) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: timeout", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "Thanks"}]
    spec = tools({"tools": [WEATHER], "tool_choice": {"type": "any"}})
    assert spec.choice == "required" and spec.forced
    assert spec.tools[0]["function"]["parameters"] == WEATHER["input_schema"]
    assert tools({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}).named
    assert not tools({"tools": [WEATHER], "tool_choice": {"type": "none"}}).active


def test_a_max_tokens_past_the_context_is_a_ceiling(aclient, demo_llm):
    """Agents send their own large default; it is clamped to the context's room, as a ceiling."""
    msg = aclient.messages.create(model=demo_llm.model_name, max_tokens=10**6, stop_sequences=["\n"],
                                  messages=[{"role": "user", "content": "What does `os.getcwd` do?"}],
                                  extra_body={"temperature": 0})
    assert msg.stop_reason in ("end_turn", "stop_sequence", "max_tokens")
