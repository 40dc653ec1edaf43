"""Issue #20's server probes: prints the figures the issue asks for, against `python -m strata serve`
on 127.0.0.1 (the CPU demo model unless a pack is given).

    python tools/probe_server.py [PACK] [--skip idle,template,...]

1. hostile requests: malformed bodies, hostile Hosts and content types; how many got a 5xx, how many a
   non-OpenAI-shaped error, and how many the server accepted that it should have refused;
2. runaway chat template: a pack whose template nests two 100,000-step loops once a chat has two turns;
   seconds until the answer (a 400 is the target) and seconds SIGINT then takes to stop that server;
3. idle sockets: with ~1,000 silent and 100 slow-header connections open, does /health answer, how fast;
4. shutdown: SIGINT with a stream and a non-stream request generating; seconds to exit and what each got.
Every loop is bounded in count and time; all traffic goes to 127.0.0.1.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

NESTED_LOOPS = ("{% if messages|length > 1 %}{% for i in range(100000) %}{% for j in range(100000) %}"
                "{% endfor %}{% endfor %}{% endif %}"
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n")
CHAT = "/v1/chat/completions"
TWO_TURNS = {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}],
             "max_tokens": 4}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str | None, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "strata", "serve", *([model] if model else []), "--port", str(self.port),
               "--device", "cpu", *extra]
        self.log = tempfile.TemporaryFile()
        # the usual default of 1,024 open files, so the idle-socket figure is that of a stock Linux box
        limit = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=limit)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start: {self.output()[-2000:]}")
            time.sleep(0.1)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def interrupt(self, limit_s: float = 30) -> float | None:
        """SIGINT; seconds until the process exited (None: still running after limit_s, then killed)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(limit_s)
            return time.monotonic() - t0
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.interrupt(10)


def raw_request(port: int, data: bytes, timeout_s: float = 20) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        try:
            s.sendall(data)
        except OSError:         # the server answered (413) and closed before the body was all sent
            pass
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except OSError:
            pass
        return out


def post(port: int, path: str, body: bytes, headers: dict | None = None, method: str = "POST") -> bytes:
    h = {"Host": f"127.0.0.1:{port}", "Content-Type": "application/json", "Content-Length": str(len(body)),
         "Connection": "close", **(headers or {})}
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items() if v is not None)
    return raw_request(port, head.encode("latin-1") + b"\r\n" + body)


def hostile_cases(port: int):
    """(name, raw answer, should_refuse): each sent on its own connection."""
    msgs = '[{"role": "user", "content": "hi"}]'
    body = lambda extra: ('{"messages": ' + msgs + ', "max_tokens": 2' + extra + "}").encode()
    cases = [
        ("lone surrogate", post(port, CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}')),
        ("depth 2000", post(port, CHAT, b"[" * 2000 + b"]" * 2000)),
        ("depth 100000", post(port, CHAT, b'{"a":' * 100000 + b"1" + b"}" * 100000)),
        ("int of 5000 digits", post(port, CHAT, body(', "seed": ' + "9" * 5000))),
        ("int of 5000 digits in prompt", post(port, "/v1/completions", b'{"prompt": [' + b"7" * 5000 + b"]}")),
        ("float 1e999", post(port, CHAT, body(', "temperature": 1e999'))),
        ("NaN", post(port, CHAT, body(', "temperature": NaN'))),
        ("float of 100000 digits", post(port, CHAT, body(', "top_p": 0.' + "1" * 100000))),
        ("invalid utf-8", post(port, CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}')),
        ("utf-16 body", post(port, CHAT, body("").decode().encode("utf-16"))),
        ("NUL in content", post(port, CHAT, b'{"messages": [{"role": "user", "content": "a\\u0000b"}]}')),
        ("10,000 messages", post(port, CHAT, ('{"messages": [' + ",".join(['{"role":"user","content":"x"}'] * 10000)
                                              + '], "max_tokens": 1}').encode())),
        ("content parts 2000 deep", post(port, CHAT, b'{"messages": [{"role": "user", "content": '
                                         + b'[{"type":"text","text":' * 2000 + b'"x"' + b"}]" * 2000 + b"}]}")),
        ("stop of 10 MB", post(port, CHAT, body(', "stop": "' + "s" * (10 << 20) + '"'))),
        ("duplicate keys", post(port, CHAT, body(', "max_tokens": "x", "max_tokens": 2'))),
        ("bad Content-Length", post(port, CHAT, body(""), {"Content-Length": "-5"})),
        ("404 route", post(port, "/v1/nothing", b"{}")),
        ("405 method", post(port, CHAT, b"", method="GET")),
        ("8 KB header", post(port, CHAT, body(""), {"X-Long": "a" * 8000})),
        ("unknown route, deep JSON", post(port, "/v1/embeddings", b"[" * 5000 + b"]" * 5000)),
    ]
    acceptable = {"utf-16 body", "NUL in content", "duplicate keys", "8 KB header"}    # valid requests
    for name, answer in cases:
        yield name, answer, name not in acceptable
    # with no API key, these are the ways a web page drives the server
    yield "text/plain body (cross-site form)", post(port, CHAT, body(""), {"Content-Type": "text/plain"}), True
    yield "no Content-Type", post(port, CHAT, body(""), {"Content-Type": None}), True
    yield "Host: evil.example (DNS rebinding)", post(port, CHAT, body(""), {"Host": "evil.example"}), True
    yield "Host: evil.example GET /v1/status", post(port, "/v1/status", b"", {"Host": "evil.example"}, "GET"), True


def parse_answer(raw: bytes) -> tuple[int, bool]:
    """(status, whether an error body has the OpenAI shape); status 0: no HTTP answer at all."""
    head, _, body = raw.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0, False
    if status < 400:
        return status, True
    try:
        err = json.loads(body)["error"]
        return status, set(err) == {"message", "type", "param", "code"}
    except (ValueError, KeyError, TypeError):
        return status, False


def probe_hostile(model) -> None:
    server = Server(model)
    try:
        rows = [(name, *parse_answer(raw), refuse) for name, raw, refuse in hostile_cases(server.port)]
        alive = httpx.get(server.url + "/health").status_code == 200
    finally:
        server.close()
    for name, status, shaped, _ in rows:
        print(f"    {name:40s} {status or 'no answer'} {'' if shaped else '(not OpenAI-shaped)'}")
    n5 = sum(1 for _, s, _, _ in rows if s >= 500 or s == 0)
    bad_shape = sum(1 for _, s, shaped, _ in rows if not shaped)
    accepted = sum(1 for _, s, _, refuse in rows if refuse and 200 <= s < 300)
    print(f"hostile requests: {len(rows)} sent, {n5} got a 5xx or no answer, {bad_shape} errors not OpenAI-shaped, "
          f"{accepted} accepted that should be refused; server alive after: {alive}")


def probe_template(model) -> None:
    src = Path(model) if model else Path(__file__).resolve().parents[1] / "strata" / "demo"
    with tempfile.TemporaryDirectory() as tmp:
        pack = Path(tmp) / "pack"
        shutil.copytree(src, pack)
        meta = json.loads((pack / "pack.json").read_text())
        meta["tokenizer"]["chat_template"] = NESTED_LOOPS
        (pack / "pack.json").write_text(json.dumps(meta))
        try:
            server = Server(str(pack))
        except RuntimeError as e:
            print(f"runaway template: refused at load: {str(e).strip().splitlines()[-1]}")
            return
        t0 = time.monotonic()
        try:
            r = httpx.post(server.url + CHAT, json=TWO_TURNS, timeout=20)
            answer = f"{r.status_code} after {time.monotonic() - t0:.2f} s: {r.text[:160]}"
        except httpx.TimeoutException:
            answer = "no answer within 20 s"
        try:
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
            after = f"a completion after it: {r.status_code}"
        except httpx.TimeoutException:
            after = "a completion after it: no answer in 10 s"
        stop_s = server.interrupt(20)
    print(f"runaway template: {answer}; {after}; SIGINT stopped the server in "
          f"{'(still running after 20 s)' if stop_s is None else f'{stop_s:.2f} s'}")


def probe_idle(model, num_idle: int = 1000, num_slow: int = 100) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * num_idle)), hard))
    server = Server(model)
    socks = []
    try:
        for i in range(num_idle + num_slow):
            try:
                s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            except OSError as e:
                print(f"    opened only {i} sockets: {e}")
                break
            if i >= num_idle:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")     # headers that never end
            socks.append(s)
        time.sleep(1.0)
        results = []
        for path, kw in (("/health", {}), ("/v1/completions", {"json": {"prompt": "hi", "max_tokens": 2}})):
            t0 = time.monotonic()
            try:
                r = httpx.request("POST" if kw else "GET", server.url + path, timeout=15, **kw)
                results.append(f"{path} {r.status_code} in {time.monotonic() - t0:.2f} s")
            except httpx.HTTPError as e:
                results.append(f"{path} failed after {time.monotonic() - t0:.2f} s ({type(e).__name__})")
        still_open = 0
        for s in socks:
            s.setblocking(False)
            try:
                still_open += s.recv(1, socket.MSG_PEEK) != b""
            except BlockingIOError:
                still_open += 1
            except OSError:
                pass
    finally:
        for s in socks:
            s.close()
        server.close()
    print(f"idle sockets: {len(socks)} open ({num_slow} with unfinished headers); normal requests: "
          f"{'; '.join(results)}; {still_open} of the idle sockets still open then")


def probe_shutdown(model) -> None:
    server = Server(model)
    got = {}

    def stream():
        lines = []
        try:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                              json={"prompt": "once upon a time", "max_tokens": 4000, "stream": True}) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        got.setdefault("stream_started", time.monotonic())
            got["stream"] = f"ended cleanly; last frames {lines[-2:]!r}"[:300]
        except httpx.HTTPError as e:
            got["stream"] = f"cut ({type(e).__name__}) after {len(lines)} frames; last {lines[-1:]!r}"[:300]

    def plain():
        try:
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4000}, timeout=30)
            got["plain"] = f"{r.status_code} {r.headers.get('content-type')}: {r.text[:150]}"
        except httpx.HTTPError as e:
            got["plain"] = f"cut ({type(e).__name__})"

    threads = [threading.Thread(target=f) for f in (stream, plain)]
    threads[0].start()
    deadline = time.monotonic() + 30
    while "stream_started" not in got and time.monotonic() < deadline:
        time.sleep(0.05)
    threads[1].start()          # queued behind the stream: the engine runs one request at a time
    time.sleep(0.5)
    stop_s = server.interrupt(30)
    for t in threads:
        t.join(30)
    if os.environ.get("PROBE_VERBOSE"):
        print(server.output()[-3000:])
    print(f"shutdown with a stream and a non-stream request generating: SIGINT to exit "
          f"{'over 30 s' if stop_s is None else f'{stop_s:.2f} s'}")
    print(f"    stream: {got.get('stream')}")
    print(f"    non-stream: {got.get('plain')}")


PROBES = {"hostile": probe_hostile, "template": probe_template, "idle": probe_idle, "shutdown": probe_shutdown}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help="a pack dir (default: the demo model)")
    ap.add_argument("--only", default=",".join(PROBES), help=f"comma list of {', '.join(PROBES)}")
    args = ap.parse_args()
    for name in args.only.split(","):
        t0 = time.monotonic()
        PROBES[name](args.model)
        print(f"    ({name}: {time.monotonic() - t0:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("NO_PROXY", "127.0.0.1")
    sys.exit(main())
