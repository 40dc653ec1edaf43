"""The FastAPI app: OpenAI routes, health, metrics, status and the Monitor page.

`create_app(llm, ...)` builds one app around one loaded model; the engine thread starts and stops
with the app's lifespan. Every error answer has the OpenAI shape {"error": {message, type, param, code}}.
Requests are untrusted: a Host allow-list (for a loopback server, so no web page can reach it by DNS
rebinding), JSON content types only on POST (a cross-site form cannot send one without a preflight),
bounded bodies, and `app.state.drain()` ends every open request at once when the server shuts down.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.scheduler import DEFAULT_QUEUE_SIZE, QueueFull
from ..errors import StrataError
from . import anthropic, schema
from .metrics import ServerMetrics
from .protocol import APIError, ChunkWriter, Logprobs, ParsedRequest, best_replies, choice_body, completion_body, \
    error_body, invalid, new_id, parse_json_object, parse_request
from .reasoning import ReasoningReader, opens_inside, reasoning_tags, split_reasoning
from .security import HostCheck
from .tools import ToolCallReader, ToolSpec, forced_call_grammar, parse_tools, render_messages, split_calls
from .worker import EngineWorker, Job

log = logging.getLogger("strata.server")
STATIC_DIR = Path(__file__).parent / "static"
DEFAULT_MAX_BODY_BYTES = 4 << 20
DISCONNECT_POLL_S = 0.25


class Draining:
    """The jobs whose answers are open, so that a shutdown can end each of them at once."""

    def __init__(self, worker: EngineWorker):
        self.worker, self.open, self.started = worker, set(), False

    def __call__(self) -> None:
        """On the event loop, as the server stops: every open request gets its 503 now."""
        self.started = True
        for job in list(self.open):
            job.events.put_nowait(("shutdown", None))
            self.worker.cancel(job)

    def refuse_if_started(self) -> None:
        if self.started:
            raise _shutting_down()


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry on another instance or after it restarts",
                    type="server_error", code="server_shutting_down")


def create_app(llm, *, api_key: str | None = None, queue_size: int = DEFAULT_QUEUE_SIZE,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, warm_up: bool = True,
               allowed_hosts: list[str] | None = None, reasoning_format: str = "auto") -> FastAPI:
    """warm_up: run llm.warm_up() before serving (the first request then costs what later ones do;
    serve_main does it itself, before printing that it serves). allowed_hosts: the Host header names
    answered (any port; "*" any name); None answers every Host (serve_main passes the loopback names
    for a loopback bind). reasoning_format: auto (a chat reply's <think> block as reasoning_content,
    where the model has those tags: strata.server.reasoning) or none."""
    if reasoning_format not in ("auto", "none"):
        raise ValueError(f"reasoning_format must be auto or none, got {reasoning_format!r}")
    think = reasoning_format == "auto" and reasoning_tags(getattr(llm, "tokenizer", None))
    metrics = ServerMetrics()
    worker = EngineWorker(llm, queue_size, metrics)
    metrics.bind(worker)
    started = time.time()
    draining = Draining(worker)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if warm_up and hasattr(llm, "warm_up"):
            await asyncio.to_thread(llm.warm_up)
            await asyncio.to_thread(_warm_grammar, llm)
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop, 2.0)    # a drained job stops at its next token

    app = FastAPI(title="Strata", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", responses=schema.errors(400, 404, 405, 500))
    app.state.llm, app.state.worker, app.state.metrics, app.state.drain = llm, worker, metrics, draining
    _install_error_handlers(app, metrics)
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=allowed_hosts, on_refusal=metrics.count_http_error)
    check_key = Depends(_key_checker(api_key))
    v1 = APIRouter(prefix="/v1", dependencies=[check_key])
    post_errors = schema.errors(401, 413, 415, 503)

    @v1.post("/chat/completions", openapi_extra=schema.request_body(schema.CHAT_REQUEST), responses=post_errors)
    async def chat_completions(request: Request):
        return await _complete(request, "chat", llm, worker, max_body_bytes, draining, think)

    @v1.post("/completions", openapi_extra=schema.request_body(schema.COMPLETION_REQUEST), responses=post_errors)
    async def completions(request: Request):
        return await _complete(request, "completion", llm, worker, max_body_bytes, draining)

    @v1.post("/messages", openapi_extra=schema.request_body(schema.MESSAGES_REQUEST),
             responses=schema.anthropic_errors(400, 401, 404, 413, 415, 503))
    async def messages(request: Request):
        return await _messages(request, llm, worker, max_body_bytes, draining, think)

    @v1.post("/messages/count_tokens", openapi_extra=schema.request_body(schema.COUNT_TOKENS_REQUEST),
             responses=schema.anthropic_errors(400, 401, 404, 413, 415))
    async def count_tokens(request: Request):
        """The prompt's size as /v1/messages would read it (Anthropic's token counting route)."""
        body = await _read_request(request, max_body_bytes, draining)
        anthropic.check_model(body, llm.model_name)
        req = ParsedRequest("chat", anthropic.chat_messages(body), False, False, None, {},
                            template_kwargs=anthropic.thinking(body, getattr(llm.tokenizer, "chat_template", "")))
        ids, _ = await asyncio.to_thread(_prepare, llm, req, anthropic.tools(body), False)
        return {"input_tokens": len(ids)}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": llm.model_name, "object": "model", "created": int(started),
                                            "owned_by": "strata", "max_context": llm.max_context}]}

    @v1.get("/status")
    async def status():
        engine = await asyncio.to_thread(worker.live_engine_status)
        server = worker.snapshot()
        return {**engine, "engine_state": engine.get("state"), **server, "model": llm.model_name,
                "device": engine.get("device", llm.device), "max_context": llm.max_context,
                "uptime_s": time.time() - started, "auth": bool(api_key)}

    app.include_router(v1)

    @app.get("/health")
    async def health():
        if not worker.alive:
            return JSONResponse({"status": "error", "message": "the engine thread is not running"}, 503)
        return {"status": "ok", "model": llm.model_name}

    @app.get("/metrics", dependencies=[check_key])
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/", include_in_schema=False)
    async def monitor():
        return FileResponse(STATIC_DIR / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app


def _warm_grammar(llm) -> None:
    """Build llguidance's view of the tokenizer now (~50-250 ms), not in the first structured request."""
    from ..engine.grammar import compiler_for
    try:
        compiler_for(llm)
    except StrataError as e:    # no llguidance, or a tokenizer it cannot read: structured requests say so
        log.warning("%s", e)


def _key_checker(api_key: str | None):
    """A dependency that demands `Authorization: Bearer <api_key>` or `x-api-key: <api_key>` (Anthropic's
    clients send that), compared in constant time."""
    def check_key(request: Request) -> None:
        if not api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        bearer = token.strip() if scheme.lower() == "bearer" else None
        offered = [t for t in (bearer, request.headers.get("x-api-key")) if t is not None]
        if not any(hmac.compare_digest(t.encode(), api_key.encode()) for t in offered):
            raise APIError(401, "a valid API key is required (Authorization: Bearer <key>, or x-api-key: <key>)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return check_key


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def answer(req: Request, status: int, body: dict, headers: dict | None = None) -> Response:
        metrics.count_http_error(status)
        if req.url.path.startswith(anthropic.ROUTE):     # Anthropic's clients read their own error shape
            body = anthropic.error_body(status, body["error"]["message"])
        # json.dumps escapes to ASCII, so a message that quotes hostile text can never fail to encode
        return Response(json.dumps(body), status, headers=headers, media_type="application/json")

    @app.exception_handler(APIError)
    async def api_error(req, e: APIError):
        return answer(req, e.status, e.body(), e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(req, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return answer(req, e.status_code, error_body(str(e.detail), code=code), getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(req, e: RequestValidationError):
        first = (e.errors() or [{}])[0]
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return answer(req, 400, error_body(f"{param}: {first.get('msg', 'invalid request')}", param=param))

    @app.exception_handler(Exception)
    async def server_error(req, e: Exception):
        # a bug: still the OpenAI shape (Starlette re-raises it afterwards, so it is logged with its traceback)
        return answer(req, 500, error_body(f"internal server error ({type(e).__name__})", "server_error",
                                           code="internal_error"))


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    too_big = APIError(413, f"the request body is larger than the server's limit of {limit} bytes",
                       code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise too_big
    return bytes(buf)


def _check_json_content_type(request: Request) -> None:
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {media or 'none'!r}",
                       code="unsupported_media_type")


NO_TOOLS = ToolSpec((), "none")


def _tokenize(llm, req: ParsedRequest, tools: ToolSpec = NO_TOOLS, prompt=None) -> list[int]:
    """The ids of the request's prompt (prompt: one of a completions batch's instead)."""
    if req.kind == "chat":
        messages, extra = render_messages(req.prompt, tools, llm.tokenizer.chat_template)
        try:
            text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     **{**req.template_kwargs, **extra})
        except StrataError as e:    # the model's template failed or ran past its budget (strata/chat_template.py)
            raise APIError(400, f"messages: the model's chat template rejected them: {e}", param="messages",
                           code="chat_template_error") from None
        return llm.tokenizer.encode(text)
    prompt = req.prompt if prompt is None else prompt
    if req.suffix is not None:      # fill-in-the-middle: the model's own prefix/suffix/middle tokens
        try:
            return llm.tokenizer.fill_in_the_middle(prompt, req.suffix)
        except StrataError as e:
            raise APIError(400, f"suffix: {e}", param="suffix", code="unsupported_parameter") from None
    return list(prompt) if isinstance(prompt, list) else llm.tokenizer.encode(prompt)


def _constraint(llm, tools: ToolSpec, fmt: tuple | None):
    """The token constraint of a forced tool call or a response_format, or None; 400 naming the field
    when the schema does not compile (or passes the grammar limits)."""
    if not tools.forced and fmt is None:
        return None
    from ..engine.grammar import GrammarError, compiler_for
    param = "tools" if tools.forced else "response_format"
    try:
        compiler = compiler_for(llm)
        if tools.forced:
            grammar = compiler.lark(forced_call_grammar(tools), "the tools' parameters schemas")
        else:
            grammar = compiler.json_schema(fmt[1], "response_format.json_schema.schema")
    except GrammarError as e:
        raise APIError(400, str(e), param=param, code="invalid_schema") from None
    except StrataError as e:        # llguidance is not installed, or cannot read this model's tokenizer
        raise APIError(400, str(e), param=param, code="unsupported_parameter") from None
    return grammar.constraint()


def _prepare(llm, req: ParsedRequest, tools: ToolSpec, constrain: bool = True):
    """(prompt ids, constraint), off the event loop: the template, the tokenizer and a grammar compile."""
    return _tokenize(llm, req, tools), _constraint(llm, tools, req.response_format) if constrain else None


def _prepare_choices(llm, req: ParsedRequest, tools: ToolSpec) -> list[tuple[list[int], object]]:
    """(prompt ids, constraint) of each choice, prompt by prompt and n of each, off the event loop:
    a prompt is tokenized once, and each choice gets its own constraint (a grammar's state is its
    reply's)."""
    out = []
    for prompt in req.prompts:
        ids = _tokenize(llm, req, tools, prompt)
        out += [(ids, _constraint(llm, tools, req.response_format)) for _ in range(req.per_prompt)]
    return out


async def _read_request(request: Request, max_body_bytes: int, draining: Draining) -> dict:
    _check_json_content_type(request)
    draining.refuse_if_started()
    return parse_json_object(await _read_body(request, max_body_bytes))


async def _submit(llm, worker: EngineWorker, draining: Draining, req: ParsedRequest, tools: ToolSpec) -> list[Job]:
    """Each choice's job (one, or n of each prompt of a batch, in index order): tokenized (and its
    grammar compiled) off the event loop, checked against the context, and queued for the engine
    thread; all of them or none (a full queue takes back the ones queued already)."""
    prepared = await asyncio.to_thread(_prepare_choices, llm, req, tools)
    draining.refuse_if_started()
    field = "messages" if req.kind == "chat" else "prompt"
    jobs = []
    for index, (ids, constraint) in enumerate(prepared):
        where = f"{field}[{index // req.per_prompt}]" if req.batch else field
        if not ids:
            raise APIError(400, f"{where} is empty after tokenization", param=field)
        if len(ids) >= llm.max_context:
            raise APIError(400, f"{where} is {len(ids)} tokens; the context holds {llm.max_context} "
                                f"(prompt + output), so at most {llm.max_context - 1} prompt tokens fit",
                           param=field, code="context_length_exceeded")
        room = llm.max_context - len(ids)
        max_tokens = None if req.max_tokens is None else min(req.max_tokens, room)
        jobs.append(Job(ids, req.params(max_tokens, index % req.per_prompt), constraint=constraint, kind=req.kind,
                        loop=asyncio.get_running_loop(), stream=req.stream))
    if len(jobs) > worker.queue_size:       # it could never wait in the queue whole, however idle the server
        param = "best_of" if req.best_of > req.n else "n" if len(req.prompts) == 1 else "prompt"
        raise invalid(param, f"this request generates {len(jobs)} replies; the server queues at most "
                             f"{worker.queue_size} (--queue-size)")
    for i, job in enumerate(jobs):
        try:
            worker.submit(job)
        except QueueFull:
            for queued in jobs[:i]:
                worker.cancel(queued)
            retry_after_s = worker.retry_after_s()
            raise APIError(503, f"the request queue is full; retry in {retry_after_s} s", type="server_error",
                           code="queue_full", headers={"Retry-After": str(retry_after_s)}) from None
    draining.open.update(jobs)
    return jobs


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _complete(request: Request, kind: str, llm, worker: EngineWorker, max_body_bytes: int,
                    draining: Draining, think: bool = False):
    body = await _read_request(request, max_body_bytes, draining)
    req = parse_request(body, kind, llm.model_name, llm.max_context, llm.tokenizer.vocab_size)
    tools = parse_tools(body) if kind == "chat" else NO_TOOLS
    jobs = await _submit(llm, worker, draining, req, tools)
    wants = req.echo or req.sampling.get("logprobs") is not None
    req_id, created = new_id(kind), int(time.time())
    logprobs = [Logprobs(llm.tokenizer, kind, job.prompt_ids if req.echo else None) if wants else None
                for job in jobs]
    # a chat reply's thinking as reasoning_content, from its start where the prompt opened <think>
    inside = [think and _thinking_opened(llm, job.prompt_ids) for job in jobs] if kind == "chat" \
        else [False] * len(jobs)
    writers = [ChunkWriter(req_id, kind, llm.model_name, req.include_usage,
                           ToolCallReader(tools) if tools.active else None, lp, index, created,
                           ReasoningReader(inside[index]) if think and kind == "chat" else None)
               for index, lp in enumerate(logprobs)]
    if req.stream:
        frames = _sse(jobs[0], worker, writers[0], draining) if len(jobs) == 1 else \
            _sse_choices(jobs, worker, writers, draining, req.n)
        return StreamingResponse(frames, media_type="text/event-stream", headers=SSE_HEADERS)
    completions = await _completions(jobs, worker, request, draining)
    if completions is None:
        return Response(status_code=499)
    keep = best_replies(completions, req.per_prompt, req.n) if req.per_prompt > req.n else range(len(completions))
    choices = []
    for index, i in enumerate(keep):
        reasoning, text = (split_reasoning(completions[i].text, inside[i]) if think and kind == "chat"
                           else (None, completions[i].text))
        reply = split_calls(text, tools) if tools.active else (text, []) if reasoning is not None else None
        choices.append(choice_body(kind, completions[i], index, reply, logprobs[i], reasoning))
    return completion_body(req_id, kind, llm.model_name, completions, created, choices, req.per_prompt)


def _thinking_opened(llm, ids: list[int]) -> bool:
    """Whether the rendered prompt ends inside a <think> it opened (its last tokens decoded)."""
    return opens_inside(llm.tokenizer.decode(ids[-16:], skip_special_tokens=False))


async def _messages(request: Request, llm, worker: EngineWorker, max_body_bytes: int, draining: Draining,
                    think: bool = False):
    """POST /v1/messages (strata/server/anthropic.py); think: the reply's thinking as a thinking block."""
    body = await _read_request(request, max_body_bytes, draining)
    anthropic.check_model(body, llm.model_name)
    max_tokens, sampling = anthropic.sampling(body, llm.max_context)
    tools = anthropic.tools(body)
    variables = anthropic.thinking(body, getattr(llm.tokenizer, "chat_template", ""))
    req = ParsedRequest("chat", anthropic.chat_messages(body), body.get("stream") is True, False, max_tokens, sampling,
                        template_kwargs=variables)
    job, = await _submit(llm, worker, draining, req, tools)
    msg_id = anthropic.new_message_id()
    inside = think and _thinking_opened(llm, job.prompt_ids)

    def stop_reason(completion, num_calls: int):
        return anthropic.stop_reason(completion, job.params.stop, _full_text(llm, completion), num_calls)
    if req.stream:
        frames = anthropic.EventWriter(msg_id, llm.model_name, tools if tools.active else None, len(job.prompt_ids),
                                       stop_reason, ReasoningReader(inside) if think else None)
        return StreamingResponse(_sse(job, worker, frames, draining), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    completion = await _completion(job, worker, request, draining)
    if completion is None:
        return Response(status_code=499)
    reasoning, text = split_reasoning(completion.text, inside) if think else (None, completion.text)
    content, calls = split_calls(text, tools) if tools.active else (text, [])
    parts = ([("thinking", reasoning)] if reasoning is not None else []) + [("text", content)] + \
        [("call", c) for c in calls]
    reason = stop_reason(completion, len(calls))
    return anthropic.message_body(msg_id, llm.model_name, completion, parts, reason)


def _full_text(llm, completion) -> str:
    """The reply's tokens decoded whole: past the returned text when a stop string cut it."""
    return llm.tokenizer.decode(completion.token_ids) if completion.finish_reason == "stop" else completion.text


def _engine_error(e: Exception) -> APIError:
    if isinstance(e, StrataError):
        return APIError(400, str(e), code="invalid_value")
    return APIError(500, f"the engine failed: {type(e).__name__}: {e}", type="server_error",
                    code="engine_error")


async def _completion(job: Job, worker: EngineWorker, request: Request, draining: Draining):
    """The finished Completion of a non-streamed job, or None when the client disconnected first; the
    job is cancelled when this ends any other way than done."""
    try:
        while True:
            try:
                kind, payload = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    worker.cancel(job)
                    return None
                continue
            if kind == "done":
                return payload
            if kind == "error":
                raise _engine_error(payload)
            if kind == "shutdown":
                raise _shutting_down()
    except BaseException:
        worker.cancel(job)
        raise
    finally:
        draining.open.discard(job)


async def _completions(jobs: list[Job], worker: EngineWorker, request: Request, draining: Draining):
    """The finished Completions of a request's jobs in order, or None when the client disconnected
    first; an engine error in one ends them all."""
    try:
        done = await asyncio.gather(*(_completion(job, worker, request, draining) for job in jobs))
    except BaseException:
        for job in jobs:
            worker.cancel(job)
        raise
    if any(c is None for c in done):
        for job in jobs:
            worker.cancel(job)
        return None
    return list(done)


async def _sse_choices(jobs: list[Job], worker: EngineWorker, writers: list[ChunkWriter], draining: Draining,
                       n: int):
    """SSE bytes of a request of several choices: each job's frames through its own writer (its
    index), interleaved as the engine gives them; one usage frame and [DONE] once every choice has
    ended. An error or a shutdown ends every choice with one error event."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, job: Job):
        while True:
            kind, payload = await job.events.get()
            await merged.put((index, kind, payload))
            if kind != "delta":
                return
    pumps = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    completions: list = [None] * len(jobs)
    try:
        for writer in writers:
            first = writer.start()
            if first:
                yield first
        while any(c is None for c in completions):
            index, kind, payload = await merged.get()
            if kind == "delta":
                out = writers[index].delta(payload)
                if out:
                    yield out
            elif kind == "done":
                completions[index] = payload
                yield writers[index].finish(payload, last=False)
            else:
                yield ChunkWriter.error(_shutting_down() if kind == "shutdown" else _engine_error(payload))
                return
        yield writers[0].end(completions, n)
    finally:
        for task in pumps:
            task.cancel()
        for job, done in zip(jobs, completions):
            draining.open.discard(job)
            if done is None:
                worker.cancel(job)


async def _sse(job: Job, worker: EngineWorker, frames, draining: Draining):
    """SSE bytes of one streamed job, OpenAI's (protocol.ChunkWriter) or Anthropic's (anthropic.EventWriter):
    frames.start(), frames.delta(text) per text delta, then frames.finish(completion) or
    frames.error(APIError). A disconnect cancels this generator, which cancels the job; a shutdown
    ends it with an error event."""
    finished = False
    try:
        first = frames.start()
        if first:
            yield first
        while True:
            kind, payload = await job.events.get()
            if kind == "delta":
                out = frames.delta(payload)
                if out:
                    yield out
                continue
            finished = True
            if kind == "done":
                yield frames.finish(payload)
            else:
                yield frames.error(_shutting_down() if kind == "shutdown" else _engine_error(payload))
            return
    finally:
        draining.open.discard(job)
        if not finished:
            worker.cancel(job)
