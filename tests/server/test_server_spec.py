"""The server with --mtp --spec: the OpenAI client's completion is plain greedy's, and the
timings, /v1/status and the recent-requests rows say how the drafts fared."""
import httpx
import pytest

from strata import LLM
from strata.server import create_app
from tests.server.helpers import LiveServer


@pytest.fixture(scope="module")
def spec_server():
    llm = LLM(device="cpu", mtp=True, spec=2)
    live = LiveServer(create_app(llm, queue_size=4))
    yield live, llm
    live.close()


def test_speculative_completion_is_greedys_and_reports_its_drafts(spec_server):
    from openai import OpenAI
    live, llm = spec_server
    client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = "The little robot wanted"
    reply = client.completions.create(model=llm.model_name, prompt=prompt, max_tokens=24, temperature=0)
    plain = LLM(device="cpu").generate(prompt, max_tokens=24)
    assert reply.choices[0].text == plain.text
    t = reply.model_extra["timings"]
    assert t["draft_n"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"]
    status = httpx.get(live.url + "/v1/status").json()
    spec = status["speculation"]
    assert spec["draft_n"] >= t["draft_n"] and 1 < spec["tokens_per_verify"] <= 3
    row = status["requests"][0]
    assert row["draft_n"] == t["draft_n"] and row["draft_acceptance"] == t["draft_n_accepted"] / t["draft_n"]
