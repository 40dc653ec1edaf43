"""A short chat turn's time to first token through `python -m strata serve` (issue #18's 19-token turn).

    python tools/ttft_server.py [PACK] [--device cuda] [--turns 6] [--words 6] [--port 0]
                                [--serve-arg=--vram-budget-gib=8 ...] [--json PATH]

Starts the server on 127.0.0.1 (the demo model unless PACK is given), waits for /health, then sends
`--turns` streamed chat requests, each a new one-message conversation of about `--words` words, and
times from the request's send to the first SSE chunk that carries content (the client's view: HTTP,
the chat template, the prompt read and the first pick). The first turn is printed apart: it pays what
warm-up left. Prompt and cached token counts come from the stream's usage chunk. Only the standard
library is used on the client side, so the tool runs wherever the server does.
"""
from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time

WORDS = ["river", "owl", "prime", "moon", "haiku", "forest", "copper", "violin", "glacier", "lantern",
         "orbit", "meadow", "falcon", "quartz", "harbor", "ember"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it answered /health")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return time.monotonic() - t0
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.25)
    raise SystemExit(f"the server did not answer /health within {timeout_s:.0f} s")


def one_turn(port: int, text: str, max_tokens: int) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                       # sampled, seeded: a random-weight synthetic model's greedy pick can be a padded vocabulary
                       # id with no text, whose turn would then stream no token to time
                       "temperature": 1.0, "seed": 0, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first_ms, usage = None, {}
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if first_ms is None and (delta.get("content") or delta.get("reasoning_content")):
                first_ms = (time.perf_counter() - t0) * 1e3
    total_ms = (time.perf_counter() - t0) * 1e3
    conn.close()
    return {"first_token_ms": first_ms, "total_ms": total_ms, "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": usage.get("cached_tokens"), "completion_tokens": usage.get("completion_tokens")}


def _ms(v: float | None) -> str:
    return "none (no text streamed)" if v is None else f"{v:.1f} ms"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--words", type=int, default=6, help="words in each user message")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=240)
    p.add_argument("--serve-arg", action="append", default=[], help="passed to serve (e.g. --serve-arg=--vram-budget-gib=8)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    port = args.port or free_port()
    cmd = [sys.executable, "-m", "strata", "serve", *([args.model] if args.model else []), "--device", args.device,
           "--host", "127.0.0.1", "--port", str(port), *args.serve_arg]
    err = tempfile.TemporaryFile("w+")         # not a pipe: a chatty server must never block on it
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
    try:
        ready_s = wait_ready(port, proc, args.ready_timeout)
        turns = []
        for i in range(args.turns):
            words = [WORDS[(i * 5 + j) % len(WORDS)] for j in range(args.words)]
            turns.append(one_turn(port, f"Tell me about {' '.join(words)}.", args.max_tokens))
            t = turns[-1]
            first = _ms(t["first_token_ms"])
            print(f"turn {i + 1}: {t['prompt_tokens']} prompt tokens ({t['cached_tokens']} cached), first token "
                  f"{first}, {t['completion_tokens']} tokens in {t['total_ms']:.1f} ms", flush=True)
        later = [t["first_token_ms"] for t in turns[1:] if t["first_token_ms"] is not None]
        summary = {"cmd": cmd[1:], "ready_s": ready_s, "turns": turns,
                   "median_later_first_token_ms": statistics.median(later) if later else None}
        print(f"server ready after {ready_s:.1f} s; time to first token: first turn "
              f"{_ms(turns[0]['first_token_ms'])}, median of the later {len(later)}: "
              f"{_ms(summary['median_later_first_token_ms'])}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.returncode not in (0, -15):
            err.seek(0)
            sys.stderr.write(err.read()[-2000:])
        err.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
