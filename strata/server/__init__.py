"""OpenAI-compatible HTTP server and the Monitor web app (`python -m strata serve`).

create_app(llm, api_key=None, queue_size=64, max_body_bytes=4 MiB, warm_up=True) -> FastAPI around one loaded model
serve_main(args) -> int     the CLI's entry point
"""
from .app import create_app
from .cli import serve_main

__all__ = ["create_app", "serve_main"]
