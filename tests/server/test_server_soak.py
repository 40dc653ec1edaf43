"""A short soak of `python -m strata serve`: 200 requests from 8 clients, some streams dropped after
their first chunk; every request that stayed gets its whole answer, and the server's RSS stays flat."""
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.server.helpers import serve_process

NUM_REQUESTS, NUM_CLIENTS, WARM_UP = 200, 8, 40
SOAK_LIMIT_S = 60


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def one_request(url: str, i: int) -> str:
    """'ok', 'dropped' (a stream this client closed on purpose) or what went wrong."""
    body = {"prompt": f"request {i} says", "max_tokens": 6, "temperature": 0.7, "seed": i}
    if i % 2:
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        return "ok" if ok else f"{r.status_code} {r.text[:200]}"
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        if r.status_code != 200:
            return f"{r.status_code}"
        lines = []
        for line in r.iter_lines():
            if line:
                lines.append(line)
            if i % 4 == 0 and len(lines) == 1:
                return "dropped"        # leaving the block closes the connection mid-stream
    return "ok" if lines and lines[-1] == "data: [DONE]" and '"finish_reason": "' in lines[-2] else f"cut {lines[-2:]}"


def test_soak(tmp_path, llm):
    args = [str(llm.pack.path), "--device", "cpu", "--max-context", "256", "--queue-size", "16"]
    with serve_process(args, tmp_path / "serve.log") as (proc, url):
        t0 = time.monotonic()
        with ThreadPoolExecutor(NUM_CLIENTS) as pool:
            warm = list(pool.map(lambda i: one_request(url, i), range(WARM_UP)))
            rss_warm = rss_bytes(proc.pid)
            rest = list(pool.map(lambda i: one_request(url, i), range(WARM_UP, NUM_REQUESTS)))
        took_s = time.monotonic() - t0
        results = warm + rest
        wrong = [r for r in results if r not in ("ok", "dropped")]
        assert not wrong, wrong[:5]
        assert results.count("dropped") == NUM_REQUESTS // 4 and took_s < SOAK_LIMIT_S
        time.sleep(0.5)     # the last dropped stream's cancel reaches the engine
        totals = httpx.get(url + "/v1/status").json()["totals"]
        assert totals["errors"] == 0 and totals["rejected"] == 0
        assert totals["requests"] + totals["cancelled"] >= NUM_REQUESTS * 3 // 4
        rss_end = rss_bytes(proc.pid)
        assert rss_end <= rss_warm * 1.05, (rss_warm, rss_end)
        assert httpx.get(url + "/health").status_code == 200

