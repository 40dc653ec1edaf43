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


@pytest.fixture(scope="package")
def demo_llm():
    import strata
    return strata.LLM(device="cpu")        # the built-in demo model: it was trained on ChatML chats


@pytest.fixture(scope="package")
def demo_server(demo_llm):
    live = LiveServer(create_app(demo_llm, queue_size=8, warm_up=False))
    yield live
    live.close()


@pytest.fixture
def demo_client(demo_server):
    from openai import OpenAI
    return OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
