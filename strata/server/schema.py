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
    "n": {"type": "integer", "minimum": 1, "maximum": 16, "description": "choices of each prompt (at most 16 "
          "choices a request)"},
    "presence_penalty": {**_NUMBER, "minimum": -2, "maximum": 2},
    "frequency_penalty": {**_NUMBER, "minimum": -2, "maximum": 2},
    "repetition_penalty": {**_NUMBER, "minimum": 0.01, "maximum": 100,
                           "description": "prompt and reply tokens: a logit > 0 divided by it, < 0 times it "
                                          "(1: none; repeat_penalty is read as the same)"},
    "logit_bias": {"type": "object", "maxProperties": 1024, "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                   "additionalProperties": {**_NUMBER, "minimum": -100, "maximum": 100},
                   "description": "token id -> a bias added to its logit"},
}
_LOGPROBS = {"type": "integer", "minimum": 0, "maximum": 20}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
_NAME = {"type": "string", "minLength": 1, "maxLength": 64, "pattern": "^[A-Za-z0-9_.-]+$"}
_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"},
                                                                        "arguments": {"type": "string"}}}}}
_MESSAGE = {
    "type": "object", "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": _TEXT_PART}]},
        "tool_calls": {"type": "array", "items": _TOOL_CALL, "description": "an assistant's earlier calls"},
        "tool_call_id": {"type": "string", "description": "on a tool message: the call it answers"},
    },
}
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": _NAME, "description": {"type": "string"},
        "parameters": {"type": "object", "description": "a JSON schema of the arguments"}}}}}
_TOOL_CHOICE = {"oneOf": [{"type": "string", "enum": ["auto", "none", "required"]},
                          {"type": "object", "required": ["type", "function"], "properties": {
                              "type": {"type": "string", "enum": ["function"]},
                              "function": {"type": "object", "required": ["name"],
                                           "properties": {"name": {"type": "string"}}}}}]}
_RESPONSE_FORMAT = {"oneOf": [
    {"type": "object", "required": ["type"],
     "properties": {"type": {"type": "string", "enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"type": "string", "enum": ["json_schema"]},
        "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "strict": {"type": "boolean"},
                                                         "schema": {"type": "object"}}}}}]}
CHAT_REQUEST = {
    "type": "object", "required": ["messages"],
    "properties": {"messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
                   "max_completion_tokens": {"type": "integer", "minimum": 1},
                   "tools": {"type": "array", "maxItems": 128, "items": _TOOL}, "tool_choice": _TOOL_CHOICE,
                   "response_format": _RESPONSE_FORMAT, **_SAMPLING,
                   "logprobs": {"type": "boolean"},
                   "top_logprobs": {**_LOGPROBS, "description": "needs logprobs: true"},
                   "chat_template_kwargs": {"type": "object", "maxProperties": 16,
                                            "description": "extra variables of the model's chat template, e.g. "
                                                           "{\"enable_thinking\": false} for Qwen3"}},
}
_BLOCK = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]},
    "text": {"type": "string"}, "thinking": {"type": "string"}, "signature": {"type": "string"},
    "id": {"type": "string"}, "name": {"type": "string"}, "input": {"type": "object"},
    "tool_use_id": {"type": "string"}, "is_error": {"type": "boolean"},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}}}
_CONTENT = {"oneOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]}
MESSAGES_REQUEST = {
    "type": "object", "required": ["model", "max_tokens", "messages"],
    "properties": {
        "model": {"type": "string", "description": "the served model's name"},
        "max_tokens": {"type": "integer", "minimum": 1},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"type": "string", "enum": ["user", "assistant"]}, "content": _CONTENT}}},
        "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
        "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16},
        "temperature": {**_NUMBER, "minimum": 0, "maximum": 1}, "top_p": {**_NUMBER, "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0}, "stream": {"type": "boolean"},
        "tools": {"type": "array", "maxItems": 128, "items": {"type": "object", "required": ["name"], "properties": {
            "name": _NAME, "description": {"type": "string"}, "input_schema": {"type": "object"}}}},
        "tool_choice": {"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"}}},
        "metadata": {"type": "object"},
        "thinking": {"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["enabled", "disabled"]}, "budget_tokens": {"type": "integer",
                                                                                      "minimum": 1}}},
    },
}
COUNT_TOKENS_REQUEST = {
    "type": "object", "required": ["model", "messages"],
    "properties": {k: MESSAGES_REQUEST["properties"][k]
                   for k in ("model", "messages", "system", "tools", "tool_choice", "thinking")},
}
_PROMPT = {"oneOf": [{"type": "string", "minLength": 1},
                     {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]}
COMPLETION_REQUEST = {
    "type": "object", "required": ["prompt"],
    "properties": {"prompt": {"oneOf": [
        *_PROMPT["oneOf"],
        {"type": "array", "minItems": 2, "maxItems": 16, "items": _PROMPT, "description": "a batch: a choice each"}]},
                   **_SAMPLING,
                   "max_tokens": {"type": "integer", "minimum": 0, "description": "0 only with echo"},
                   "best_of": {"type": "integer", "minimum": 1, "maximum": 16,
                               "description": "replies generated per prompt, the n with the highest mean "
                                             "log-probability returned (not streamed when above n)"},
                   "logprobs": {**_LOGPROBS, "description": "each token's log-probability and its k likeliest rivals"},
                   "echo": {"type": "boolean", "description": "the text (and logprobs) start with the prompt's"},
                   "suffix": {"type": "string", "description": "the text after the gap: fill-in-the-middle with the "
                                                               "model's own FIM tokens (not with echo)"}},
}
ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_ERROR_ANSWER = {"content": {"application/json": {"schema": ERROR}}}
ANTHROPIC_ERROR = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"type": "string", "enum": ["error"]},
                   "error": {"type": "object", "required": ["type", "message"],
                             "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
}


def errors(*statuses: int) -> dict:
    """The `responses` entries for these error statuses, all in the OpenAI error shape."""
    return {s: {"description": "an OpenAI-style error", **_ERROR_ANSWER} for s in statuses}


def anthropic_errors(*statuses: int) -> dict:
    """The `responses` entries of /v1/messages: Anthropic's error shape."""
    return {s: {"description": "an Anthropic-style error",
                "content": {"application/json": {"schema": ANTHROPIC_ERROR}}} for s in statuses}


def request_body(schema: dict) -> dict:
    """openapi_extra for a route that reads its JSON body itself."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
