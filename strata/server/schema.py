"""OpenAPI descriptions of the request bodies and error answers (the app checks requests by hand in
protocol.py; these tell clients and fuzzers what it accepts). Kept beside the checks they describe:
a field added to protocol.py belongs here too."""
from __future__ import annotations

_NUMBER = {"type": "number"}
_STOP = {"oneOf": [{"type": "string", "minLength": 1},
                   {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16}]}
_SAMPLING = {
    "model": {"type": "string", "description": "optional; when given, the served model's name"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {**_NUMBER, "minimum": 0, "maximum": 2},
    "top_p": {**_NUMBER, "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0},
    "seed": {"type": "integer"},
    "stop": _STOP,
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "n": {"type": "integer", "minimum": 1, "maximum": 1},
    "presence_penalty": {**_NUMBER, "minimum": 0, "maximum": 0},
    "frequency_penalty": {**_NUMBER, "minimum": 0, "maximum": 0},
}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
_MESSAGE = {
    "type": "object", "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": _TEXT_PART}]},
    },
}
CHAT_REQUEST = {
    "type": "object", "required": ["messages"],
    "properties": {"messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
                   "max_completion_tokens": {"type": "integer", "minimum": 1}, **_SAMPLING},
}
COMPLETION_REQUEST = {
    "type": "object", "required": ["prompt"],
    "properties": {"prompt": {"oneOf": [{"type": "string", "minLength": 1},
                                        {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]},
                   **_SAMPLING},
}
ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_ERROR_ANSWER = {"content": {"application/json": {"schema": ERROR}}}


def errors(*statuses: int) -> dict:
    """The `responses` entries for these error statuses, all in the OpenAI error shape."""
    return {s: {"description": "an OpenAI-style error", **_ERROR_ANSWER} for s in statuses}


def request_body(schema: dict) -> dict:
    """openapi_extra for a route that reads its JSON body itself."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
