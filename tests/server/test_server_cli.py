"""`python -m strata serve` as a user runs it: a subprocess, the API key from the environment."""
import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command_with_api_key_from_environment(tmp_path, llm):
    port = free_port()
    env = {**os.environ, "STRATA_API_KEY": "env-key"}
    cmd = [sys.executable, "-m", "strata", "serve", str(llm.pack.path), "--port", str(port), "--device", "cpu",
           "--max-context", "256", "--queue-size", "4"]
    log = tmp_path / "serve.log"
    with open(log, "ab") as out:        # the child's own file offset; reading here must not move it
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert httpx.get(url + "/v1/models").status_code == 401
        models = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer env-key"}).json()
        assert models["data"][0]["max_context"] == 256
        status = httpx.get(url + "/v1/status", headers={"Authorization": "Bearer env-key"}).json()
        assert status["queue"]["max"] == 4 and status["auth"] is True
    finally:
        proc.terminate()
        proc.wait(10)
    assert "strata: serving pack on cpu" in log.read_text()
