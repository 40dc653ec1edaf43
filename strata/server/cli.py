"""`python -m strata serve`: load the model, then run the app under uvicorn (strata/cli.py parses the flags)."""
from __future__ import annotations

import argparse
import sys

from ..config import env_value
from .app import DEFAULT_MAX_BODY_BYTES, DEFAULT_QUEUE_SIZE, create_app


def serve_main(args: argparse.Namespace) -> int:
    """Serve args.model (None: the demo model) on args.host:args.port; returns the exit status.

    Reads model, host, port, api_key (else $STRATA_API_KEY), queue_size, max_body_bytes and the
    EngineConfig fields from `args`.
    """
    import uvicorn

    from .. import LLM
    from ..cli import engine_kwargs

    queue_size = getattr(args, "queue_size", None) or DEFAULT_QUEUE_SIZE
    max_body_bytes = getattr(args, "max_body_bytes", None) or DEFAULT_MAX_BODY_BYTES
    if queue_size < 1 or max_body_bytes < 1:
        print("strata serve: --queue-size and --max-body-bytes must be positive", file=sys.stderr)
        return 2
    api_key = getattr(args, "api_key", None) or env_value("API_KEY") or None
    llm = LLM(args.model, **engine_kwargs(args))
    app = create_app(llm, api_key=api_key, queue_size=queue_size, max_body_bytes=max_body_bytes)
    print(f"strata: serving {llm.model_name} on {llm.device} at http://{args.host}:{args.port}/ "
          f"(OpenAI API under /v1{', API key required' if api_key else ''})", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)
    return 0
