"""Many clients at once, and clients that leave early."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from strata.server import create_app
from tests.server.helpers import LiveServer, SlowLLM

TOPICS = ["rivers", "mountains", "compilers", "bread", "tides", "jazz", "moths", "glaciers"]


def ask(client, model, topic, stream):
    kw = dict(model=model, messages=[{"role": "user", "content": f"Write about {topic}."}], temperature=0,
              max_tokens=10)
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def test_eight_concurrent_clients(server, llm):
    clients = [OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) for _ in TOPICS]
    expected = {t: ask(clients[0], llm.model_name, t, stream=False) for t in TOPICS}
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        futures = {t: pool.submit(ask, c, llm.model_name, t, i % 2 == 0)
                   for i, (t, c) in enumerate(zip(TOPICS, clients))}
        got = {t: f.result(timeout=120) for t, f in futures.items()}
    assert got == expected
    assert all(finish == "length" for _, finish in got.values())


@pytest.mark.parametrize("batch_max", [0, 2])
def test_eight_clients_over_parallel_slots_get_the_replies_of_one_slot(server, llm, batch_max):
    # the same weights with --parallel 4: replies batched four at a time (or two, --batch-max 2; or as
    # the auto rule groups them) equal the one-slot server's
    from tests.server.helpers import endless_llm
    par = endless_llm(llm.pack.path, parallel=4, batch_max=batch_max)
    clients = [OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) for _ in TOPICS]
    expected = {t: ask(clients[0], llm.model_name, t, stream=False) for t in TOPICS}
    live = LiveServer(create_app(par, queue_size=16))
    try:
        pclients = [OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60) for _ in TOPICS]
        with ThreadPoolExecutor(len(TOPICS)) as pool:
            futures = {t: pool.submit(ask, c, par.model_name, t, i % 2 == 1)
                       for i, (t, c) in enumerate(zip(TOPICS, pclients))}
            got = {t: f.result(timeout=120) for t, f in futures.items()}
        status = httpx.get(live.url + "/v1/status").json()
    finally:
        live.close()
    assert got == expected
    assert status["slots"] == {"busy": 0, "total": 4}
    assert status["batching"]["batch_max"] == batch_max and status["batching"]["auto"] == (batch_max == 0)
    assert status["batching"]["cap"] <= (batch_max or 4)


def cancelled_rows(url):
    return [r for r in httpx.get(url + "/v1/status").json()["requests"] if r["finish_reason"] == "cancelled"]


def wait_cancelled(url, n, timeout_s=15):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = cancelled_rows(url)
        if len(rows) >= n:
            return rows
        time.sleep(0.05)
    raise AssertionError(f"expected {n} cancelled requests, status shows {len(cancelled_rows(url))}")


def wait_for_status(url, predicate, timeout_s=15):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate(httpx.get(url + "/v1/status").json()):
            return
        time.sleep(0.01)
    raise AssertionError("the server never reached the expected state")


def wait_for_tokens(url, n):
    wait_for_status(url, lambda s: s["current"] is not None and s["current"]["tokens"] >= n)


def wait_for_queue(url, depth):
    wait_for_status(url, lambda s: s["queue"]["depth"] >= depth)


def test_dropped_clients_are_cancelled_and_others_unharmed(llm):
    live = LiveServer(create_app(SlowLLM(llm, token_s=0.01), queue_size=16))
    model = llm.model_name
    try:
        client = OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60)
        expected = {t: ask(client, model, t, stream=False) for t in TOPICS[:3]}
        body = {"model": model, "prompt": "a long story", "max_tokens": 800, "temperature": 0, "stream": True}
        results = {}

        def others():
            for t in TOPICS[:3]:
                results[t] = ask(client, model, t, stream=t != TOPICS[0])

        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            wait_for_tokens(live.url, 5)                    # a few tokens are out...
            worker = threading.Thread(target=others)        # ...others queue behind it...
            worker.start()
            wait_for_queue(live.url, 1)
        # ...and the client hangs up mid-stream.
        worker.join(60)
        assert results == expected
        rows = wait_cancelled(live.url, 1)
        assert rows[-1]["completion_tokens"] < 800

        # A non-streamed request whose client gives up is cancelled too.
        try:
            httpx.post(live.url + "/v1/completions", json={**body, "stream": False}, timeout=0.5)
        except httpx.TimeoutException:
            pass
        rows = wait_cancelled(live.url, 2)
        assert rows[0]["completion_tokens"] < 800
        assert httpx.get(live.url + "/health").json()["status"] == "ok"
        assert ask(client, model, TOPICS[0], stream=True) == expected[TOPICS[0]]
        status = httpx.get(live.url + "/v1/status").json()
        assert status["state"] == "idle" and status["totals"]["cancelled"] == 2
    finally:
        live.close()
