import pytest

from strata.server import create_app
from tests.server.helpers import LiveServer, tiny_llm


@pytest.fixture(scope="package")
def llm(tmp_path_factory):
    return tiny_llm(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="package")
def server(llm):
    live = LiveServer(create_app(llm, queue_size=32))
    yield live
    live.close()


@pytest.fixture
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
