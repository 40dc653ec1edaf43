"""The Host allow-list: an ASGI middleware that answers a Host header not on the list with a 400.

A server on 127.0.0.1 with no API key is reachable from any web page the user opens, through DNS
rebinding (evil.example resolving to 127.0.0.1): the browser then sends `Host: evil.example`. Only
the names on the list are answered (any port), so such a page gets a 400 and never the answer.
"""
from __future__ import annotations

import json
from typing import Callable

from . import anthropic
from .protocol import error_body

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def loopback(host: str) -> bool:
    """Whether a bind address only listens on this machine."""
    h = host.strip("[]").lower()
    return h == "localhost" or h == "::1" or h.startswith("127.")


def host_name(header: str) -> str:
    """The name part of a Host header, port dropped: 'localhost:8080' -> 'localhost', '[::1]:80' -> '[::1]'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[:header.find("]") + 1] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class HostCheck:
    def __init__(self, app, allowed: list[str], on_refusal: Callable[[int], None] | None = None):
        self.app = app
        self.any = "*" in allowed
        self.allowed = {host_name(h) for h in allowed}
        self.on_refusal = on_refusal

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.any:
            return await self.app(scope, receive, send)
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
        if host_name(header) in self.allowed:
            return await self.app(scope, receive, send)
        if self.on_refusal:
            self.on_refusal(400)
        names = ", ".join(sorted(self.allowed))
        message = (f"Host {header[:100]!r} is not one this server answers to ({names}, any port; "
                   f"serve --allowed-hosts adds names)")
        shaped = (anthropic.error_body(400, message) if scope.get("path", "").startswith(anthropic.ROUTE)
                  else error_body(message, param="Host", code="invalid_host"))
        body = json.dumps(shaped).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
