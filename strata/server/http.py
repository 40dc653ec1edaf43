"""The HTTP layer under the app: uvicorn's h11 protocol with a header-read timeout and a connection
cap, and a uvicorn Server whose shutdown first ends the app's open requests.

uvicorn alone bounds neither idle nor slow-header sockets: `timeout_keep_alive` starts only after a
first response (and any byte received cancels it), and `limit_concurrency` still accepts every
socket, answering a plain-text 503 once a request arrives. So here every connection has
`header_timeout_s` to finish its request headers (again after each keep-alive response), and past
`max_connections` a new connection closes the oldest one still waiting for headers: a normal request
gets through however many silent sockets are open, and the server never runs out of descriptors.
"""
from __future__ import annotations

import json
import resource
import socket
import time
from typing import Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import error_body

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 512
GRACEFUL_SHUTDOWN_S = 1.0      # the backstop; the app's drain ends open requests at once
FDS_PER_SPARE = 64             # descriptors kept for the model's files, logs and the listener


def _raw_json_response(status: int, reason: str, body: dict, extra: str = "") -> bytes:
    data = json.dumps(body).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
            f"connection: close\r\n{extra}\r\n").encode() + data


class GuardedH11Protocol(H11Protocol):
    """H11Protocol plus the header timeout and the connection cap (class attributes: see guarded_protocol)."""

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    max_connections = DEFAULT_MAX_CONNECTIONS

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._opened_at = time.monotonic()
        self._header_timer = None
        live = [c for c in self.connections if not c.transport.is_closing()]    # a closed one leaves the set later
        if len(live) > self.max_connections:
            waiting = [c for c in live if c is not self and c.waiting_for_headers()]
            if not waiting:      # every connection is in a request: this one is told to come back
                body = error_body("the server has too many open connections; retry shortly", "server_error",
                                  code="too_many_connections")
                transport.write(_raw_json_response(503, "Service Unavailable", body, "retry-after: 1\r\n"))
                transport.close()
                return
            min(waiting, key=lambda c: c._opened_at).drop()
        self._arm_header_timer()

    def waiting_for_headers(self) -> bool:
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def drop(self) -> None:
        self._cancel_header_timer()
        if not self.transport.is_closing():
            self.transport.close()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.waiting_for_headers():
            self.drop()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self.waiting_for_headers():
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()     # the next request's headers get the same time, however slow the bytes

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """Malformed HTTP gets the OpenAI error shape too (uvicorn's own answer is plain text)."""
        self.transport.write(_raw_json_response(400, "Bad Request", error_body(msg, code="invalid_http")))
        self.transport.close()


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[GuardedH11Protocol]:
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "max_connections": max_connections})


def connection_cap(wanted: int = DEFAULT_MAX_CONNECTIONS) -> int:
    """wanted, or fewer if this process's open-file limit (raised to its hard limit first) cannot hold them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > soft):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return wanted if soft == resource.RLIM_INFINITY else max(1, min(wanted, soft - FDS_PER_SPARE))


class StrataServer(uvicorn.Server):
    """uvicorn.Server whose shutdown calls `drain` first, so open requests end (an SSE error event, or
    a 503) at once instead of being cut when the graceful-shutdown time runs out."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], None] | None = None):
        super().__init__(config)
        self._drain = drain

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:     # stop accepting before the drain, so nothing new starts
            server.close()
        if self._drain is not None:
            self._drain()
        await super().shutdown(sockets)


def server_config(app, *, port: int, log_level: str = "info", header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                  max_connections: int = DEFAULT_MAX_CONNECTIONS) -> uvicorn.Config:
    return uvicorn.Config(app, port=port, log_level=log_level, http=guarded_protocol(header_timeout_s, max_connections),
                          timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)


def serve_on(app, sock: socket.socket, **kwargs) -> None:
    """Run `app` (from create_app) on the bound socket until SIGINT/SIGTERM or should_exit."""
    server = StrataServer(server_config(app, port=sock.getsockname()[1], **kwargs), app.state.drain)
    server.run(sockets=[sock])
