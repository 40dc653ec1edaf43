"""Prometheus metrics of one server, in a registry of its own (two apps in one process never collide)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("strata_requests", "Requests finished, by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.http_errors = Counter("strata_http_errors", "Error answers, by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("strata_prompt_tokens", "Prompt tokens, reused ones included", registry=r)
        self.cached_tokens = Counter("strata_cached_tokens", "Prompt tokens reused from the prefix cache",
                                     registry=r)
        self.completion_tokens = Counter("strata_completion_tokens", "Generated tokens", registry=r)
        self.request_s = Histogram("strata_request_duration_seconds", "Time from arrival to the last token",
                                   buckets=_LATENCY_BUCKETS_S, registry=r)
        self.first_token_s = Histogram("strata_time_to_first_token_seconds",
                                       "Time from arrival to the first token (queue + prompt)",
                                       buckets=_LATENCY_BUCKETS_S, registry=r)
        self.queue_depth = Gauge("strata_queue_depth", "Requests waiting for the engine", registry=r)
        self.busy = Gauge("strata_engine_busy", "1 while the engine runs a request", registry=r)
        self.prompt_tps = Gauge("strata_prompt_tokens_per_second", "New prompt tokens/s of the last request",
                                registry=r)
        self.decode_tps = Gauge("strata_decode_tokens_per_second", "Decode tokens/s of the last request",
                                registry=r)
        self.hit_rate = Gauge("strata_expert_cache_hit_rate", "Expert-cache hit rate of the last request",
                              registry=r)
        self.bytes_h2d = Gauge("strata_host_to_device_bytes", "Bytes copied host to device since start",
                               registry=r)

    def bind(self, worker) -> None:
        """Gauges that read the worker at scrape time."""
        self.queue_depth.set_function(worker.queue_depth)
        self.busy.set_function(lambda: 0 if worker.snapshot()["current"] is None else 1)

    def count_request(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def count_http_error(self, status: int) -> None:
        self.http_errors.labels(str(status)).inc()

    def observe(self, endpoint: str, completion, row: dict, request, engine_status: dict) -> None:
        """One finished request, a strata.engine.scheduler.Request (called on the engine thread)."""
        self.count_request(endpoint, completion.finish_reason)
        self.prompt_tokens.inc(row["prompt_tokens"])
        self.cached_tokens.inc(row["cached_tokens"])
        self.completion_tokens.inc(row["completion_tokens"])
        self.request_s.observe(row["duration_ms"] / 1e3)
        if request.first_token is not None:
            self.first_token_s.observe(request.first_token - request.created)
        for gauge, value in ((self.prompt_tps, row["prompt_tps"]), (self.decode_tps, row["decode_tps"]),
                             (self.hit_rate, row["hit_rate"]),
                             (self.bytes_h2d, (engine_status or {}).get("bytes_h2d"))):
            if value is not None:
                gauge.set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
