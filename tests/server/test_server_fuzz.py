"""schemathesis over the published OpenAPI document against a live server: no request it generates
(valid or not) may get a 5xx. Bounded: a fixed number of examples per operation, and the model
wrapped so no reply is longer than a few tokens."""
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from strata.server import create_app  # noqa: E402
from tests.server.helpers import LiveServer  # noqa: E402

MAX_REPLY_TOKENS = 3


class ShortLLM:
    """The LLM with every request's max_tokens cut to MAX_REPLY_TOKENS (the fuzzer asks for thousands)."""

    def __init__(self, llm):
        self._llm = llm

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def begin(self, ids, params, **kwargs):
        short = dataclasses.replace(params, max_tokens=min(params.max_tokens or MAX_REPLY_TOKENS, MAX_REPLY_TOKENS))
        return self._llm.begin(ids, short, **kwargs)


@pytest.fixture(scope="module")
def fuzz_server(llm):
    live = LiveServer(create_app(ShortLLM(llm), queue_size=8, allowed_hosts=["127.0.0.1", "localhost"]))
    yield live
    live.close()


EXAMPLES = 25       # per operation and mode: ~6 operations x 2 modes x 25 stays under ~25 s on 2 cores


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_request_gets_a_server_error(fuzz_server, mode):
    # driven through hypothesis directly: schemathesis's pytest plugin does not run under this pytest
    api = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/messages"}
    for op in operations:
        if mode == "negative" and op.method.upper() != "POST":
            continue        # an operation with no parameters has no invalid form to generate
        @given(case=op.as_strategy(generation_mode=GenerationMode(mode)))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def call(case):
            case.call_and_validate(base_url=fuzz_server.url, checks=[not_a_server_error], timeout=30)
        call()
