"""The OpenAI wire protocol: request checking (errors that name the field) and response bodies.

Checking is by hand rather than through pydantic models so that every rejection is a one-line
OpenAI-style error naming the field, and so that fields Strata does not know are ignored (clients
send vendor extensions). Known parameters Strata does not support yet are rejected, not ignored.
"""
from __future__ import annotations

import codecs
import json
import math
import time
import uuid
from dataclasses import dataclass, field

from ..config import MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS, MIN_REPETITION_PENALTY, \
    SamplingParams

MAX_STOP_STRINGS = 16
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """A request the server answers with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type, self.headers = type, headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{param}: {what} is not supported by Strata yet", param=param,
                    code="unsupported_parameter")


MAX_JSON_DEPTH = 32            # a chat request nests 5 deep (messages, a message, content, a part)
MAX_INT_DIGITS = 20            # any int64 (token ids, seeds); Python's own 4,300-digit limit fails as a 500
MAX_FLOAT_CHARS = 40


def _int_literal(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise APIError(400, f"request body: an integer literal of {len(text)} digits; at most {MAX_INT_DIGITS} "
                            f"are accepted", code="invalid_json")
    return int(text)


def _float_literal(text: str) -> float:
    value = float(text) if len(text) <= MAX_FLOAT_CHARS else math.nan
    if not math.isfinite(value):
        raise APIError(400, f"request body: the number {text[:MAX_FLOAT_CHARS]}{'...' if len(text) > MAX_FLOAT_CHARS else ''} "
                            f"is out of range (at most {MAX_FLOAT_CHARS} characters, finite)", code="invalid_json")
    return value


def _constant(name: str):
    raise APIError(400, f"request body: {name} is not JSON", code="invalid_json")


def _check_tree(body) -> None:
    """Depth at most MAX_JSON_DEPTH and no lone surrogate ("\ud800" parses, then fails every encoder)."""
    stack = [(body, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"request body: nested deeper than {MAX_JSON_DEPTH} levels (at {where.lstrip('.')[:60]})",
                           code="invalid_json")
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            path = f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]"
            for text in (key, item):
                if isinstance(text, str):
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError:
                        name = path.lstrip(".").encode("utf-8", "backslashreplace").decode()
                        raise APIError(400, f"{name}: not valid Unicode (a lone surrogate escape such as \\ud800)",
                                       param=name, code="invalid_value") from None
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1, path))


def parse_json_object(raw: bytes) -> dict:
    """The request body as a dict; APIError 400 for anything else, including bodies nested too deep
    and numbers too long to be a parameter (both cost the parser time and memory for nothing)."""
    try:
        body = json.loads(raw, parse_int=_int_literal, parse_float=_float_literal, parse_constant=_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, f"request body: nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}",
                       code="invalid_json")
    _check_tree(body)
    return body


# ---- typed field readers: each names the field it rejects ----

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise invalid(name, f"{name} must be a number, got {v!r}", "invalid_type")
    if not lo <= v <= hi:
        raise invalid(name, f"{name} must be between {lo} and {hi}, got {v!r}")
    return float(v)


def _integer(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise invalid(name, f"{name} must be an integer, got {v!r}", "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise invalid(name, f"{name} must be {bound}, got {v}")
    return v


def _boolean(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise invalid(name, f"{name} must be a boolean, got {v!r}", "invalid_type")
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or any(not isinstance(s, str) for s in items):
        raise invalid("stop", f"stop must be a string or a list of strings, got {v!r}", "invalid_type")
    if len(items) > MAX_STOP_STRINGS:
        raise invalid("stop", f"stop has {len(items)} strings; at most {MAX_STOP_STRINGS} are allowed")
    if any(not s for s in items):
        raise invalid("stop", "stop strings must not be empty")
    return tuple(items)


def _reject_unsupported(body: dict, kind: str) -> None:
    """Known OpenAI parameters whose non-default values Strata cannot honour yet."""
    if kind == "chat":
        if body.get("functions"):
            raise unsupported("functions", "the deprecated functions parameter (use tools)")


def _adjustments(body: dict, kind: str, vocab_size: int) -> dict:
    """The SamplingParams of strata.engine.logits that the body sets: OpenAI's presence_penalty,
    frequency_penalty, logit_bias and logprobs (chat: logprobs + top_logprobs; completions: logprobs
    as a count, and with echo the prompt's too), and repetition_penalty (vLLM's name; llama.cpp's
    repeat_penalty is read as the same)."""
    out = {name: _number(body, name, 0.0, -2.0, 2.0) for name in ("presence_penalty", "frequency_penalty")}
    names = [n for n in ("repetition_penalty", "repeat_penalty") if body.get(n) is not None]
    if len(names) == 2 and body[names[0]] != body[names[1]]:
        raise invalid(names[1], "repetition_penalty and repeat_penalty are the same setting; give one")
    for name in names[:1]:
        out["repetition_penalty"] = _number(body, name, 1.0, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
    out["logit_bias"] = _logit_bias(body, vocab_size)
    if kind == "chat":
        top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if _boolean(body, "logprobs"):
            out["logprobs"] = top or 0
        elif top is not None:
            raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    else:
        out["logprobs"] = _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)
        if _boolean(body, "echo") and out["logprobs"] is not None:
            out["prompt_logprobs"] = out["logprobs"]
    return out


def _logit_bias(body: dict, vocab_size: int) -> tuple:
    """logit_bias {"token id": bias -100..100} -> ((id, bias), ...), naming the entry it rejects."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise invalid("logit_bias", "logit_bias must be an object mapping token ids to biases", "invalid_type")
    if len(v) > MAX_LOGIT_BIAS:
        raise invalid("logit_bias", f"logit_bias has {len(v)} tokens; at most {MAX_LOGIT_BIAS} are allowed")
    out = []
    for key, bias in v.items():
        where = f"logit_bias[{key[:24]!r}]"
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= MAX_INT_DIGITS else -1
        if not 0 <= token < vocab_size:
            raise invalid("logit_bias", f"{where}: the key must be a token id in [0, {vocab_size})")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise invalid("logit_bias", f"{where}: the bias must be a number from -100 to 100, got {bias!r}")
        out.append((token, float(bias)))
    return tuple(out)


# ---- prompts ----

def _forced_choice(choice) -> bool:
    return choice == "required" or isinstance(choice, dict)


def response_format(body: dict) -> tuple[str, dict | None] | None:
    """response_format -> None (text), ("json_object", None) or ("json_schema", schema)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type", "text"), str):
        raise invalid("response_format", "response_format must be an object with a type", "invalid_type")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", None)
    if kind != "json_schema":
        raise invalid("response_format.type", f"response_format.type must be text, json_object or json_schema, "
                                              f"got {kind[:40]!r}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise invalid("response_format.json_schema", "response_format.json_schema must be an object whose schema "
                                                     "is a JSON schema object", "invalid_type")
    if not isinstance(spec.get("name", ""), str):
        raise invalid("response_format.json_schema.name", "response_format.json_schema.name must be a string",
                      "invalid_type")
    return ("json_schema", spec.get("schema", {}))


def chat_messages(body: dict) -> list[dict]:
    """messages -> [{"role", "content": str, and for an assistant "tool_calls", for a tool "tool_call_id"}],
    text parts joined; names the offending element."""
    msgs = body.get("messages")
    if msgs is None:
        raise invalid("messages", "messages is required", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages", "messages must be a non-empty list of message objects", "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(where, f"{where} must be an object, got {m!r}", "invalid_type")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"{where}.role", f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        msg = {"role": role, "content": _message_text(m.get("content"), f"{where}.content")}
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise invalid(f"{where}.tool_call_id", f"{where}.tool_call_id must be a string", "invalid_type")
            msg["tool_call_id"] = call_id or ""
        out.append(msg)
    return out


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls, with each call's arguments parsed from their JSON text
    (chat templates expect an object; text that is not JSON is passed as it is)."""
    if not isinstance(calls, list):
        raise invalid(where, f"{where} must be a list", "invalid_type")
    out = []
    for i, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments", ""), str):
            raise invalid(f"{where}[{i}]", f"{where}[{i}] must be {{\"type\": \"function\", \"function\": "
                                           f"{{\"name\": str, \"arguments\": str}}}}", "invalid_type")
        try:
            args = json.loads(f.get("arguments") or "{}")
        except ValueError:
            args = f["arguments"]
        out.append({"id": c.get("id") if isinstance(c.get("id"), str) else "", "type": "function",
                    "function": {"name": f["name"], "arguments": args}})
    return out


def _message_text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise invalid(where, f"{where} must be a string or a list of content parts", "invalid_type")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid(f"{where}[{j}]", f"{where}[{j}] must be a content part object with a type", "invalid_type")
        if part["type"] != "text":
            raise unsupported(f"{where}[{j}].type", f"content of type {part['type']!r}")
        if not isinstance(part.get("text"), str):
            raise invalid(f"{where}[{j}].text", f"{where}[{j}].text must be a string", "invalid_type")
        texts.append(part["text"])
    return "".join(texts)


def completion_prompts(body: dict, vocab_size: int) -> list[str | list[int]]:
    """prompt -> its prompts, each a string or a list of token ids: one, or a batch (a list of
    strings or of token id lists, as OpenAI's legacy route takes them), naming the bad element."""
    p = body.get("prompt")
    if p is None:
        raise invalid("prompt", "prompt is required", "missing_required_parameter")
    batch = isinstance(p, list) and bool(p) and all(isinstance(x, (str, list)) for x in p)
    items = p if batch else [p]
    out = []
    for i, item in enumerate(items):
        where = f"prompt[{i}]" if batch else "prompt"
        if isinstance(item, str):
            if not item:
                raise invalid("prompt", f"{where} must not be empty")
            out.append(item)
        elif isinstance(item, list) and item and all(_is_int(x) for x in item):
            bad = [x for x in item if not 0 <= x < vocab_size]
            if bad:
                raise invalid("prompt", f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
            out.append(item)
        else:
            raise invalid("prompt", f"{where} must be a non-empty string or a list of token ids", "invalid_type")
    return out


TEMPLATE_RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception",
                     "strftime_now")
MAX_TEMPLATE_KWARGS = 16


def template_kwargs(body: dict) -> dict:
    """chat_template_kwargs (vLLM's and llama.cpp's extension: e.g. {"enable_thinking": false} for
    Qwen3) -> the extra variables the model's chat template is rendered with, naming what it rejects."""
    v = body.get("chat_template_kwargs")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise invalid("chat_template_kwargs", "chat_template_kwargs must be an object of template variables",
                      "invalid_type")
    if len(v) > MAX_TEMPLATE_KWARGS:
        raise invalid("chat_template_kwargs", f"chat_template_kwargs has {len(v)} variables; at most "
                                              f"{MAX_TEMPLATE_KWARGS} are allowed")
    for key in v:
        if not key.isidentifier() or key.startswith("_"):
            raise invalid("chat_template_kwargs", f"chat_template_kwargs: {key[:40]!r} is not a template variable "
                                                  f"name")
        if key in TEMPLATE_RESERVED:
            raise invalid("chat_template_kwargs", f"chat_template_kwargs: {key} is set by the request itself")
    return dict(v)


# ---- the whole request ----

MAX_CHOICES = 16        # choices of one request: n x the prompts of a completions batch


@dataclass
class ParsedRequest:
    kind: str                               # "chat" | "completion"
    prompt: list[dict] | str | list[int]    # messages, text, or token ids (a batch's first prompt)
    stream: bool
    include_usage: bool
    max_tokens: int | None
    sampling: dict = field(default_factory=dict)   # SamplingParams fields except max_tokens
    response_format: tuple | None = None           # None, ("json_object", None) or ("json_schema", schema)
    echo: bool = False                              # a completion's text (and logprobs) start with the prompt's
    n: int = 1                                      # choices of each prompt
    batch: list = field(default_factory=list)       # a completion's prompts (prompt is the first)
    suffix: str | None = None                       # a completion's text after the gap (fill-in-the-middle)
    best_of: int = 1                                # replies generated per prompt; the n likeliest are returned
    template_kwargs: dict = field(default_factory=dict)     # chat_template_kwargs: the template's extra variables

    @property
    def per_prompt(self) -> int:
        """Replies generated for each prompt: best_of, at least n."""
        return max(self.n, self.best_of)

    @property
    def prompts(self) -> list:
        return self.batch or [self.prompt]

    def params(self, max_tokens: int | None, choice: int = 0) -> SamplingParams:
        """The params of reply `choice` of a prompt: a seeded request's replies draw from seed,
        seed + 1, ... (one seed would give n equal samples); with best_of above n each reply keeps
        its tokens' log-probabilities, which rank them."""
        seed = self.sampling.get("seed")
        sampling = dict(self.sampling)
        if choice and seed is not None:
            sampling["seed"] = (seed + choice) % 2**63
        if self.best_of > self.n and sampling.get("logprobs") is None:
            sampling["logprobs"] = 0
        return SamplingParams(max_tokens=max_tokens, **sampling)


def best_replies(completions: list, per_prompt: int, n: int) -> list[int]:
    """The indices of the n replies of each prompt's per_prompt with the highest mean log-probability
    per token (OpenAI's best_of), likeliest first; a reply of no token ranks after every other."""
    out = []
    for start in range(0, len(completions), per_prompt):
        def score(i):
            lps = completions[i].logprobs or []
            return sum(e.logprob for e in lps) / len(lps) if lps else -math.inf
        group = range(start, start + per_prompt)
        out += sorted(group, key=lambda i: (-score(i), i))[:n]
    return out


def parse_request(body: dict, kind: str, model_name: str, max_context: int, vocab_size: int) -> ParsedRequest:
    model = body.get("model")
    if model is not None and model != model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")
    _reject_unsupported(body, kind)
    prompts = [chat_messages(body)] if kind == "chat" else completion_prompts(body, vocab_size)
    n = _integer(body, "n", lo=1, hi=MAX_CHOICES) or 1
    best_of = (_integer(body, "best_of", lo=1, hi=MAX_CHOICES) or n) if kind == "completion" else n
    if best_of < n:
        raise invalid("best_of", f"best_of ({best_of}) must be at least n ({n})")
    if best_of > n and _boolean(body, "stream"):
        raise invalid("best_of", "best_of above n cannot be streamed: the best replies are known at the end")
    if best_of * len(prompts) > MAX_CHOICES:
        raise invalid("n" if len(prompts) == 1 else "prompt", f"{len(prompts)} prompts x {best_of} replies is "
                      f"{best_of * len(prompts)}; one request may generate at most {MAX_CHOICES}")
    stream = _boolean(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise invalid("stream_options", "stream_options must be an object", "invalid_type")
    include_usage = bool(stream and opts and _boolean(opts, "include_usage"))
    limit_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    echo = kind == "completion" and _boolean(body, "echo")
    suffix = body.get("suffix") if kind == "completion" else None
    if suffix is not None and not isinstance(suffix, str):
        raise invalid("suffix", f"suffix must be a string, got {type(suffix).__name__}", "invalid_type")
    if suffix is not None and echo:
        raise invalid("suffix", "suffix (fill-in-the-middle) and echo cannot both be given")
    max_tokens = _integer(body, limit_name, lo=0 if echo else 1, hi=max_context)    # echo: 0 scores the prompt
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)      # OpenAI's default
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:                        # the limit top_p -> 0 keeps only the likeliest token
        temperature, top_p = 0.0, 1.0
    top_k = _integer(body, "top_k", lo=0) or 0
    seed = _integer(body, "seed")
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "stop": _stop(body),
                "seed": None if seed is None else seed % 2**63, **_adjustments(body, kind, vocab_size)}
    fmt = response_format(body) if kind == "chat" else None
    if fmt is not None and _forced_choice(body.get("tool_choice")):
        raise invalid("response_format", "response_format and a forced tool_choice cannot both shape one reply")
    return ParsedRequest(kind, prompts[0], stream, include_usage, max_tokens, sampling, fmt, echo, n,
                         prompts if len(prompts) > 1 else [], suffix, best_of,
                         template_kwargs(body) if kind == "chat" else {})


# ---- response bodies ----

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage_body(completion, n: int = 1) -> dict:
    """usage of one completion, or of a request's list of them: n choices of each prompt read the
    prompt's tokens once as OpenAI counts them (every n-th completion's prompt is a new prompt)."""
    done = completion if isinstance(completion, list) else [completion]
    prompt = sum(c.usage.prompt_tokens for c in done[::n])
    cached = sum(c.usage.cached_tokens for c in done[::n])
    reply = sum(c.usage.completion_tokens for c in done)
    return {"prompt_tokens": prompt, "completion_tokens": reply, "total_tokens": prompt + reply,
            "cached_tokens": cached, "prompt_tokens_details": {"cached_tokens": cached}}


def timings_body(completion) -> dict:
    t = completion.timings
    return t.to_dict() if hasattr(t, "to_dict") else dict(vars(t))


def _finish(reason: str) -> str:
    return reason if reason in ("stop", "length") else "stop"


def openai_tool_call(call: dict, index: int | None = None) -> dict:
    """A call read from the model's text ({id, name, arguments}) in OpenAI's tool_calls shape."""
    out = {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
    return out if index is None else {"index": index, **out}


LOGPROB_FLOOR = -9999.0         # what a -inf log-probability is written as (JSON has no infinity)


class Logprobs:
    """The logprobs bodies of one reply from strata.engine.logits' TokenLogprob entries: chat's
    {"content": [{token, logprob, bytes, top_logprobs}]}, and the legacy completions' parallel lists
    {tokens, token_logprobs, top_logprobs, text_offset}, whose offsets count characters of the
    returned text, the echoed prompt first (`echo`: its token ids, or None). Each token's text is
    its bytes (Tokenizer.token_bytes) read as UTF-8, a piece of a character as U+FFFD; `bytes`
    has them exact."""

    def __init__(self, tokenizer, kind: str, echo: list[int] | None = None):
        self.tok, self.kind, self.echo = tokenizer, kind, echo
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._offset = 0

    def echo_text(self) -> str:
        """The prompt as the completion's text starts with it: every token, special ones too."""
        return self.tok.decode(self.echo, skip_special_tokens=False)

    def _piece(self, token: int) -> tuple[str, bytes]:
        raw = self.tok.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), raw

    def chat(self, entries) -> dict:
        def one(token, lp):
            text, raw = self._piece(token)
            return {"token": text, "logprob": max(lp, LOGPROB_FLOOR), "bytes": list(raw)}
        return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}
                            for e in entries], "refusal": None}

    def completion(self, tokens, entries) -> dict:
        """tokens[i] with entries[i] (None: nothing predicts it, the prompt's first token)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, e in zip(tokens, entries):
            text, raw = self._piece(token)
            out["tokens"].append(text)
            out["text_offset"].append(self._offset)
            self._offset += len(self._decoder.decode(raw))
            out["token_logprobs"].append(None if e is None else max(e.logprob, LOGPROB_FLOOR))
            out["top_logprobs"].append(None if e is None else
                                       {self._piece(t)[0]: max(v, LOGPROB_FLOOR) for t, v in e.top})
        return out

    def body(self, completion) -> dict | None:
        """The whole reply's logprobs (None where the request asked for none)."""
        if completion.logprobs is None and completion.prompt_logprobs is None:
            return None
        if self.kind == "chat":
            return self.chat(completion.logprobs or [])
        tokens, entries = [], []
        if self.echo is not None and completion.prompt_logprobs is not None:
            tokens, entries = list(self.echo), list(completion.prompt_logprobs)
        tokens += completion.token_ids
        entries += completion.logprobs or [None] * len(completion.token_ids)
        return self.completion(tokens, entries)


def choice_body(kind: str, completion, index: int = 0, reply: tuple[str, list[dict]] | None = None,
                logprobs: Logprobs | None = None, reasoning: str | None = None) -> dict:
    """One choice of a reply. reply: (content, tool calls) when the request had tools or its reasoning
    was split out; else the whole text is the content. logprobs: where the request asked for them (or
    for echo). reasoning: the reply's thinking (strata.server.reasoning), where it had some."""
    lp = logprobs.body(completion) if logprobs is not None else None
    if kind == "chat":
        content, calls = reply if reply is not None else (completion.text, [])
        message = {"role": "assistant", "content": content if content or not calls else None}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [openai_tool_call(c) for c in calls]
        finish = "tool_calls" if calls and completion.finish_reason != "length" else _finish(completion.finish_reason)
        return {"index": index, "message": message, "logprobs": lp, "finish_reason": finish}
    echo = logprobs.echo_text() if logprobs is not None and logprobs.echo is not None else ""
    return {"index": index, "text": echo + completion.text, "logprobs": lp,
            "finish_reason": _finish(completion.finish_reason)}


def completion_body(req_id: str, kind: str, model: str, completions: list, created: int,
                    choices: list[dict], n: int = 1) -> dict:
    """The reply to a request: its choices (choice_body, in index order) and the usage of all its
    completions (the first one's timings)."""
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return {"id": req_id, "object": obj, "created": created, "model": model, "choices": choices,
            "usage": usage_body(completions, n), "timings": timings_body(completions[0])}


class ChunkWriter:
    """Server-sent-event frames of one streamed reply, in the shape the OpenAI clients parse: start(),
    delta(text) per text delta, then finish(completion) or error(APIError) (the app's SSE loop calls
    them so). reader: a strata.server.tools.ToolCallReader when the request had tools; their calls
    then go out as tool_calls deltas."""

    def __init__(self, req_id: str, kind: str, model: str, include_usage: bool = False, reader=None,
                 logprobs: Logprobs | None = None, index: int = 0, created: int | None = None, thinking=None):
        self.req_id, self.kind, self.model = req_id, kind, model
        self.include_usage, self.reader, self.index = include_usage, reader, index
        self.thinking = thinking        # a strata.server.reasoning.ReasoningReader: thinking as reasoning_content
        self.created = int(time.time()) if created is None else created
        self.obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        # logprobs: each text frame carries the entries of the tokens since the last one; a
        # completion's echo goes first, with the first delta (the prompt's logprobs come with it)
        self.logprobs, self._entries = logprobs, []
        self._echo = logprobs is not None and logprobs.echo is not None

    def _frame(self, choices: list, **extra) -> bytes:
        body = {"id": self.req_id, "object": self.obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}
        return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict:
        lp = self._take_logprobs() if text or finish else None
        if self.kind == "chat":
            delta = {} if text is None else {"content": text}
            if role:
                delta["role"] = "assistant"
            return {"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {"index": self.index, "text": text or "", "logprobs": lp, "finish_reason": finish}

    def _take_logprobs(self) -> dict | None:
        if self.logprobs is None or not self._entries:
            return None
        pairs, self._entries = self._entries, []
        if self.kind == "chat":
            return self.logprobs.chat([e for _, e in pairs])
        return self.logprobs.completion([t for t, _ in pairs], [e for _, e in pairs])

    def _echo_frame(self, prompt_logprobs) -> bytes:
        """The completion's echoed prompt, once, before any of the reply."""
        if not self._echo:
            return b""
        self._echo = False
        if prompt_logprobs is not None:
            self._entries = list(zip(self.logprobs.echo, prompt_logprobs)) + self._entries
        return self._frame([self._choice(self.logprobs.echo_text(), None)])

    def start(self) -> bytes:
        return self._frame([self._choice("", None, role=True)]) if self.kind == "chat" else b""

    def delta(self, text) -> bytes:
        """The frames of a text delta (a str, or a strata Delta when the request wants logprobs;
        None: the reply's end), tool calls split out when reading them."""
        if text is not None and not isinstance(text, str):          # a Delta: its token's entry waits
            head = self._echo_frame(text.prompt_logprobs)           # for the next frame with text
            if text.logprob is not None:
                self._entries.append((text.token_id, text.logprob))
            return head + self._text(text.text)
        return (self._echo_frame(None) if text is not None else b"") + self._text(text)

    def _text(self, text: str | None) -> bytes:
        if self.thinking is None:
            return self._answer(text)
        parts = self.thinking.push(text) if text is not None else self.thinking.finish()
        out = b""
        for kind, part in parts:
            out += self._reasoning(part) if kind == "reasoning" else self._answer(part)
        return out + (self._answer(None) if text is None else b"")

    def _reasoning(self, text: str) -> bytes:
        if not text:
            return b""
        return self._frame([{"index": self.index, "delta": {"reasoning_content": text},
                             "logprobs": self._take_logprobs(), "finish_reason": None}])

    def _answer(self, text: str | None) -> bytes:
        if self.reader is None:
            return self._frame([self._choice(text, None)]) if text else b""
        parts = self.reader.push(text) if text is not None else self.reader.finish()
        out, index = b"", self.reader.num_calls - sum(k == "call" for k, _ in parts)
        for k, part in parts:
            if k == "text":
                out += self._frame([self._choice(part, None)]) if part else b""
            else:
                out += self._tool_call(part, index)
                index += 1
        return out

    def _tool_call(self, call: dict, index: int) -> bytes:
        """One whole call as one delta (name and all its arguments: a client joins the pieces anyway)."""
        return self._frame([{"index": self.index, "delta": {"tool_calls": [openai_tool_call(call, index)]},
                             "logprobs": None, "finish_reason": None}])

    def finish(self, completion, last: bool = True) -> bytes:
        """The choice's last frames; with `last` (the request's only or last choice to end) also the
        usage frame where asked and [DONE] (end() writes those for a request of several choices)."""
        out = self._echo_frame(completion.prompt_logprobs)        # a reply of no token: still echoed
        out += self.delta(None)         # text or a call the reader still held
        reason = _finish(completion.finish_reason)
        if self.reader is not None and self.reader.num_calls and completion.finish_reason != "length":
            reason = "tool_calls"
        out += self._frame([self._choice(None, reason)], timings=timings_body(completion))
        return out + (self.end([completion]) if last else b"")

    def end(self, completions: list, n: int = 1) -> bytes:
        """The usage frame of every choice's completion (where asked), then [DONE]."""
        usage = self._frame([], usage=usage_body(completions, n)) if self.include_usage else b""
        return usage + b"data: [DONE]\n\n"

    @staticmethod
    def error(err: APIError) -> bytes:
        return b"data: " + json.dumps(err.body()).encode() + b"\n\ndata: [DONE]\n\n"
