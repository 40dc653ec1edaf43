"""`python -m strata serve` as a user runs it: a subprocess, the API key from the environment."""
import os

import httpx

from tests.server.helpers import serve_process


def test_serve_command_with_api_key_from_environment(tmp_path, llm):
    env = {**os.environ, "STRATA_API_KEY": "env-key"}
    log = tmp_path / "serve.log"
    with serve_process([str(llm.pack.path), "--device", "cpu", "--max-context", "256", "--queue-size", "4"],
                       log, env=env) as (_, url):
        assert httpx.get(url + "/v1/models").status_code == 401
        models = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer env-key"}).json()
        assert models["data"][0]["max_context"] == 256
        status = httpx.get(url + "/v1/status", headers={"Authorization": "Bearer env-key"}).json()
        assert status["queue"]["max"] == 4 and status["auth"] is True
        assert status["slots"]["total"] == 4 and status["parallel_source"].startswith("auto: 4")   # serve's default
    assert "strata: serving pack on cpu" in log.read_text() and "4 parallel slots (auto: 4" in log.read_text()
