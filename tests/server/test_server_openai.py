"""The official openai client against the live server: both endpoints, both modes, usage, stops, reuse."""
import httpx
import pytest

MAX_TOKENS = 12


def chat_prompt_tokens(llm, messages):
    return len(llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)))


def stream_chat(client, **kwargs):
    text, finish, usage = "", None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage


def stream_completion(client, **kwargs):
    text, finish, usage = "", None, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text or ""
            finish = choice.finish_reason or finish
    return text, finish, usage


def test_chat_stream_equals_non_stream_and_usage_is_right(client, llm):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three colours of the rainbow."}]
    kw = dict(model=llm.model_name, messages=messages, temperature=0, max_tokens=MAX_TOKENS)
    full = client.chat.completions.create(**kw)
    text, finish, usage = stream_chat(client, **kw)
    assert full.choices[0].message.role == "assistant"
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason == "length"
    n_prompt = chat_prompt_tokens(llm, messages)
    for u in (full.usage, usage):
        assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (n_prompt, MAX_TOKENS, n_prompt + MAX_TOKENS)
    # The repeat reuses all of the prompt but the last token (the engine always reads at least one).
    assert usage.prompt_tokens_details.cached_tokens == n_prompt - 1


def test_completion_stream_equals_non_stream(client, llm):
    prompt = "The quick brown fox jumps over"
    kw = dict(model=llm.model_name, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
    full = client.completions.create(**kw)
    text, finish, usage = stream_completion(client, **kw)
    assert text == full.choices[0].text
    assert finish == full.choices[0].finish_reason == "length"
    n_prompt = len(llm.tokenizer.encode(prompt))
    assert full.usage.prompt_tokens == usage.prompt_tokens == n_prompt
    assert full.usage.completion_tokens == usage.completion_tokens == MAX_TOKENS


def test_completion_from_token_ids_and_seeded_sampling(client, llm):
    ids = llm.tokenizer.encode("def fibonacci(n):")
    kw = dict(model=llm.model_name, prompt=ids, temperature=0.9, top_p=0.9, seed=1234, max_tokens=MAX_TOKENS,
              extra_body={"top_k": 40})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == len(ids)


def stop_piece(text: str) -> str | None:
    """A printable piece (two characters if it can) of a reply's valid-UTF-8 head, as a stop string.

    A random model's bytes are often not UTF-8; text after an invalid byte is only released when the
    reply ends, so a stop string is looked for in the head before it (never at its very start).
    """
    head = text.split("\ufffd")[0]
    for width in (2, 1):
        for i in range(len(head) - width, 0, -1):
            piece = head[i:i + width]
            if piece.isprintable() and piece.strip():
                return piece
    return None


PROMPTS = ["Once upon a time", "The river bends where", "In the beginning", "Dear reader,", "Hello", "The answer is",
           "Chapter one", "import numpy as np", "Yesterday", "To whom it may concern", "Roses are red",
           "Q: what is 2+2?", "def main():", "# Title", "It was a dark", "Step 1:", "Ingredients:",
           "SELECT * FROM", "The end.", "Abstract"]


def test_stop_strings_are_honoured(client, llm):
    for prompt in PROMPTS:
        kw = dict(model=llm.model_name, prompt=prompt, temperature=0, max_tokens=24)
        text = client.completions.create(**kw).choices[0].text
        stop = stop_piece(text)
        if stop:
            break
    else:
        pytest.fail("no greedy reply had a printable character to stop at")
    expected = text[:text.index(stop)]
    full = client.completions.create(stop=[stop, "\x00never"], **kw)
    streamed, finish, _ = stream_completion(client, stop=stop, **kw)
    assert full.choices[0].text == streamed == expected
    assert full.choices[0].finish_reason == finish == "stop"
    assert full.usage.completion_tokens <= 24


def test_follow_up_turn_reports_cached_tokens(client, llm):
    messages = [{"role": "user", "content": "Tell me about tokenizers, in one line please."}]
    first = client.chat.completions.create(model=llm.model_name, messages=messages, temperature=0, max_tokens=8)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And about experts?"}]
    second = client.chat.completions.create(model=llm.model_name, messages=messages, temperature=0, max_tokens=8)
    n_first = chat_prompt_tokens(llm, messages[:1])
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= n_first
    assert second.usage.prompt_tokens == chat_prompt_tokens(llm, messages)
    assert second.usage.model_extra["cached_tokens"] == cached      # also top-level, for convenience
    t = second.model_extra["timings"]
    assert t["cache_n"] == cached and t["prompt_n"] == second.usage.prompt_tokens - cached
    assert t["predicted_n"] == second.usage.completion_tokens
    assert {"prompt_ms", "predicted_ms", "draft_n", "draft_n_accepted"} <= set(t)


def test_models_health_metrics_status(client, server, llm):
    assert [m.id for m in client.models.list().data] == [llm.model_name]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    reply = client.completions.create(model=llm.model_name, prompt="metrics", max_tokens=2)
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert "strata_completion_tokens_total" in metrics.text and "strata_queue_depth" in metrics.text
    status = httpx.get(server.url + "/v1/status").json()
    assert status["model"] == llm.model_name and status["device"] == llm.device
    assert status["state"] in ("idle", "reading", "generating", "queued")
    assert {"prefill_chunk", "prefill_ring", "expert_cache", "bytes_h2d", "gpu", "queue", "requests"} <= set(status)
    last = status["requests"][0]
    assert last["completion_tokens"] == 2 and last["duration_ms"] > 0
    read = reply.usage.prompt_tokens - reply.usage.prompt_tokens_details.cached_tokens
    assert status["last_prompt"] == {"chunk": read, "ring": 0, "tokens_read": read}   # CPU: one chunk, no ring
