"""Start `python -m strata serve` on 127.0.0.1, wait for /health, ask for one completion, and
always stop the server; exit 0 only if both answered. Run it from outside the source tree, with
the Python the wheel was installed into:

    python ci/smoke_serve.py [--timeout-s 240]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, server: subprocess.Popen, deadline: float) -> str:
    """The served model's name, once /health answers."""
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"smoke_serve: the server exited with {server.returncode} before /health answered")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as resp:
                if resp.status == 200:
                    return json.loads(resp.read())["model"]
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise SystemExit("smoke_serve: /health did not answer 200 in time")


def complete(base: str, model: str, deadline: float) -> str:
    body = json.dumps({"model": model, "prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=max(1.0, deadline - time.monotonic())) as resp:
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise SystemExit(f"smoke_serve: /v1/completions answered {exc.code}: {exc.read()[:300]!r}") from None
    text = answer["choices"][0]["text"]
    if not text or answer.get("usage", {}).get("completion_tokens", 0) < 1:
        raise SystemExit(f"smoke_serve: an empty completion: {answer}")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=240.0, help="for start-up and the completion together")
    args = parser.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.timeout_s
    server = subprocess.Popen([sys.executable, "-m", "strata", "serve", "--host", "127.0.0.1", "--port", str(port)])
    try:
        model = wait_healthy(base, server, deadline)
        print(f"smoke_serve: /health ok ({model}); completion {complete(base, model, deadline)!r}", flush=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
