"""Send one long prompt to a running `python -m strata serve` and report what the server did with it.

    python tools/long_prompt_client.py --port 8093 --tokens 13000 --pack PACK_DIR

Waits for /health, reads the context the server reports (/v1/models), builds a prompt of at least
--tokens tokens with the pack's own tokenizer (so the count is exact), posts one /v1/completions
request with max_tokens 8 and prints the prompt tokens the server counted, the time to the answer and
the server's timings. Exit 0 only when the server accepted and answered the whole prompt.
Standard library only, 127.0.0.1 only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request


def call(port: int, path: str, body: dict | None = None, timeout: float = 600.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_healthy(port: int, seconds: float, pid: int | None = None) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if pid is not None and not os.path.exists(f"/proc/{pid}"):
            raise SystemExit(f"server process {pid} ended before it was healthy")
        try:
            call(port, "/health", timeout=5)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1.0)
    raise SystemExit(f"server on port {port} not healthy after {seconds:.0f} s")


def long_prompt(pack: str, tokens: int) -> tuple[str, int]:
    from strata.pack import open_pack
    from strata.tokenizer import Tokenizer
    p = open_pack(pack)
    tok = Tokenizer(p.tokenizer_path, p.tokenizer_meta)
    unit = "def add(a, b):\n    return a + b  # sums two numbers\n"
    text, n = unit, len(tok.encode(unit))
    text = unit * (tokens // max(n, 1) + 1)
    return text, len(tok.encode(text))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--tokens", type=int, default=13000)
    ap.add_argument("--pack", required=True, help="the pack the server runs (for its tokenizer)")
    ap.add_argument("--wait", type=float, default=180.0, help="seconds to wait for /health")
    ap.add_argument("--server-pid", type=int, default=None, help="stop waiting if this process ends")
    a = ap.parse_args()
    text, n = long_prompt(a.pack, a.tokens)
    wait_healthy(a.port, a.wait, a.server_pid)
    models = call(a.port, "/v1/models")
    print(f"server: {json.dumps(models['data'][0])}")
    t0 = time.perf_counter()
    try:
        out = call(a.port, "/v1/completions", {"model": models["data"][0]["id"], "prompt": text, "max_tokens": 8,
                                                "temperature": 0})
    except urllib.error.HTTPError as e:
        print(f"refused: HTTP {e.code}: {e.read().decode(errors='replace')[:400]}")
        return 1
    secs = time.perf_counter() - t0
    usage = out.get("usage", {})
    print(f"prompt of {n} tokens (client count): server counted {usage.get('prompt_tokens')} prompt tokens, "
          f"{usage.get('completion_tokens')} completion tokens, answered in {secs:.2f} s")
    if "timings" in out:
        print(f"timings: {json.dumps(out['timings'])}")
    return 0 if usage.get("prompt_tokens", 0) >= a.tokens else 1


if __name__ == "__main__":
    sys.exit(main())
