import pytest

from strata.server import create_app
from tests.server.helpers import LiveServer, endless_llm, tiny_pack


@pytest.fixture(scope="package")
def llm(tmp_path_factory):
    return endless_llm(tiny_pack(tmp_path_factory.mktemp("model")))


@pytest.fixture(scope="package")
def server(llm):
    live = LiveServer(create_app(llm, queue_size=32))
    yield live
    live.close()


@pytest.fixture
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
