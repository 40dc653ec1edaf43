"""`python -m strata serve`: check the address, load the model, warm it up, then run the app under
uvicorn on the socket bound first (strata/cli.py parses the flags)."""
from __future__ import annotations

import argparse
import errno
import socket
import sys

from ..config import env_value
from ..errors import InvalidArgument
from .app import DEFAULT_MAX_BODY_BYTES, DEFAULT_QUEUE_SIZE, create_app
from .http import connection_cap, serve_on
from .security import LOOPBACK_HOSTS, loopback


def bind_address(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (not listening yet, so nobody connects before the model is
    ready), or InvalidArgument saying which of host or port is wrong. Port 0: any free port."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgument(f"--port {port}: a TCP port is 1 to 65535 (0 picks a free one)")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise InvalidArgument(f"--host {host!r}: cannot be resolved ({getattr(e, 'strerror', None) or e})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn does: TIME_WAIT is no obstacle
        sock.bind(addr)
    except OSError as e:
        sock.close()
        where = f"{host}:{port}"
        if e.errno == errno.EADDRINUSE:
            raise InvalidArgument(f"--port {port}: {where} is already in use (another server?); choose "
                                  f"another --port") from None
        if e.errno == errno.EACCES:
            raise InvalidArgument(f"--port {port}: binding {where} is not permitted (ports below 1024 need "
                                  f"privileges)") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise InvalidArgument(f"--host {host}: not an address of this machine") from None
        raise InvalidArgument(f"--host/--port {where}: cannot bind ({e.strerror or e})") from None
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}/"


def _given(args, name: str, default: int) -> int:
    value = getattr(args, name, None)
    return default if value is None else value      # 0 is a value (refused below), not "unset"


def api_key_from(args) -> str | None:
    """--api-key, else $STRATA_API_KEY, else None; an empty key is refused rather than taken as no key."""
    flag, env = getattr(args, "api_key", None), env_value("API_KEY")
    if flag == "" or (flag is None and env == ""):
        where = "--api-key" if flag == "" else "STRATA_API_KEY"
        raise InvalidArgument(f"{where} is empty, which would leave the server open to anyone; give a key, "
                              f"or leave it unset to serve without one")
    return flag or env or None


def allowed_hosts_from(args) -> list[str] | None:
    """The Host allow-list: the loopback names (for a loopback bind) plus --allowed-hosts; None: any Host
    (a server bound to a public address is reached by names it cannot know, unless they are given)."""
    extra = [h.strip() for h in (getattr(args, "allowed_hosts", None) or "").split(",") if h.strip()]
    if loopback(args.host):
        return [*LOOPBACK_HOSTS, *extra]
    return extra or None


def serve_main(args: argparse.Namespace) -> int:
    """Serve args.model (None: the demo model) on args.host:args.port; returns the exit status.

    Reads model, host, port, api_key (else $STRATA_API_KEY), allowed_hosts, queue_size, max_body_bytes
    and the EngineConfig fields from `args`. Every start-up failure is a StrataError (one line, exit 2),
    raised before the model loads where it can be: the flags, then the address.
    """
    from .. import LLM
    from ..config import EngineConfig, engine_kwargs

    queue_size = _given(args, "queue_size", DEFAULT_QUEUE_SIZE)
    max_body_bytes = _given(args, "max_body_bytes", DEFAULT_MAX_BODY_BYTES)
    if queue_size < 1 or max_body_bytes < 1:
        raise InvalidArgument("--queue-size and --max-body-bytes must be positive")
    api_key = api_key_from(args)
    allowed_hosts = allowed_hosts_from(args)
    kwargs = {"parallel": "auto", **engine_kwargs(args)}    # serving: as many slots as the plan holds
    EngineConfig.from_kwargs(**kwargs)          # bad engine flags fail before the address is taken
    sock = bind_address(args.host, args.port)
    try:
        llm = LLM(args.model, **kwargs)
        warm_s = llm.warm_up()
        app = create_app(llm, api_key=api_key, queue_size=queue_size, max_body_bytes=max_body_bytes,
                         warm_up=False, allowed_hosts=allowed_hosts,
                         reasoning_format=getattr(args, "reasoning_format", None) or "auto")
        print(f"strata: serving {llm.model_name} on {llm.device} at {_url(sock)} "
              f"(OpenAI API under /v1{', API key required' if api_key else ''}); context {llm.max_context} "
              f"tokens ({llm.context_source}); {llm.config.parallel} parallel slot"
              f"{'s' if llm.config.parallel > 1 else ''}{f' ({llm.parallel_source})' if llm.parallel_source else ''}; "
              f"warmed up in {warm_s * 1e3:.0f} ms", file=sys.stderr, flush=True)
        serve_on(app, sock, max_connections=connection_cap())
    finally:
        sock.close()
    return 0
