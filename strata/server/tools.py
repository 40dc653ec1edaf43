"""Tool calls: request checking, rendering tools into the prompt, and reading calls back out.

The wire form inside the model's text is Qwen3's: each call is `<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>`; Qwen3-Coder's `<tool_call>` blocks of `<function=...>` and `<parameter=...>` tags
are read back too (xml_call). A chat template that reads a `tools` variable (Qwen3's does) renders tools,
assistant tool calls and tool results itself. A template that does not (the demo's plain ChatML)
gets Strata's rendering, done on the messages before the template sees them:
- a system message (prepended, or appended to the first system message) lists the tools as JSON
  lines inside `<tools></tools>` and says how to call one;
- an assistant turn's tool calls follow its text as `<tool_call>` blocks;
- tool results become a user turn of `<tool_response>...</tool_response>` blocks.
tool_choice "required" or a named function is enforced with a grammar (one call, arguments valid
for the function's parameters schema), so even a small model answers with a well-formed call.
"""
from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass

from .protocol import invalid

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
MAX_NAME_CHARS = 64

TOOLS_PREAMBLE = (
    "# Tools\n\nYou can call functions to help answer. Their signatures, one JSON object a line, are inside "
    "<tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, answer with a JSON object holding its "
    "name and its arguments inside <tool_call></tool_call> tags, one block per call:\n"
    "<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}}\n</tool_call>"
)


@dataclass(frozen=True)
class ToolSpec:
    """The request's tools and tool_choice, checked. choice: auto | none | required | a function's name."""
    tools: tuple[dict, ...]          # OpenAI's {"type": "function", "function": {name, description, parameters}}
    choice: str
    named: bool = False              # choice is a function's name

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.active and (self.named or self.choice == "required")

    def functions(self) -> list[dict]:
        fs = [t["function"] for t in self.tools]
        return [f for f in fs if f["name"] == self.choice] if self.named else fs


def parse_tools(body: dict) -> ToolSpec:
    """tools and tool_choice of an OpenAI chat request -> ToolSpec (400s naming the field)."""
    raw = body.get("tools")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise invalid("tools", "tools must be a list of tool objects", "invalid_type")
    if len(raw) > MAX_TOOLS:
        raise invalid("tools", f"tools has {len(raw)} entries; at most {MAX_TOOLS} are accepted")
    tools, names = [], set()
    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        if not (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)):
            raise invalid(where, f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", "invalid_type")
        f = function_def(t["function"], f"{where}.function")
        if f["name"] in names:
            raise invalid(f"{where}.function.name", f"{where}.function.name {f['name']!r} is given twice")
        names.add(f["name"])
        tools.append({"type": "function", "function": f})
    choice = body.get("tool_choice")
    if choice is None:
        return ToolSpec(tuple(tools), "auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise invalid("tool_choice", f"tool_choice must be auto, none, required or a function, got {choice!r}")
        if choice == "required" and not tools:
            raise invalid("tool_choice", "tool_choice is required but no tools are given")
        return ToolSpec(tuple(tools), choice)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and isinstance(
        choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise invalid("tool_choice", "tool_choice must be a string or {\"type\": \"function\", \"function\": "
                                     "{\"name\": ...}}", "invalid_type")
    if name not in names:
        raise invalid("tool_choice", f"tool_choice names the function {name[:MAX_NAME_CHARS]!r}, which is not in tools")
    return ToolSpec(tuple(tools), name, named=True)


def function_def(f: dict, where: str) -> dict:
    """{name, description, parameters} of one function, checked (shared with /v1/messages)."""
    name = f.get("name")
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or not all(
            c.isalnum() or c in "_-." for c in name):
        raise invalid(f"{where}.name", f"{where}.name must be 1 to {MAX_NAME_CHARS} letters, digits, '_', '-' or '.'")
    desc = f.get("description", "")
    if not isinstance(desc, str):
        raise invalid(f"{where}.description", f"{where}.description must be a string", "invalid_type")
    params = f.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise invalid(f"{where}.parameters", f"{where}.parameters must be a JSON schema object", "invalid_type")
    return {"name": name, **({"description": desc} if desc else {}), "parameters": params}


# ---- rendering ----

@functools.lru_cache(maxsize=16)
def template_reads_tools(source: str) -> bool:
    """Whether a chat template uses a `tools` variable (then it renders tools and calls itself)."""
    from jinja2 import meta

    from ..chat_template import environment
    try:
        return "tools" in meta.find_undeclared_variables(environment().parse(source))
    except Exception:       # a template that does not parse fails at render time with its own message
        return False


def call_text(name: str, arguments) -> str:
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def render_messages(messages: list[dict], tools: ToolSpec, template_source: str) -> tuple[list[dict], dict]:
    """(messages, extra template variables) for the chat template; see the module doc."""
    listed = [t for t in tools.tools] if tools.active else []
    if template_reads_tools(template_source):
        return messages, ({"tools": listed} if listed else {})
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        content = m["content"]
        calls = m.get("tool_calls") or []
        if calls:
            blocks = [call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            content = "\n".join([content] * bool(content) + blocks)
        out.append({"role": m["role"], "content": content})
    if listed:
        preamble = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in listed))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{preamble}"}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return [{"role": m["role"], "content": m["content"]} for m in out], {}


def forced_call_grammar(tools: ToolSpec) -> str:
    """The Lark grammar (llguidance's dialect) of one call to one of tools.functions()."""
    from ..engine.grammar import JSON_OPTIONS
    variants = []
    for f in tools.functions():
        params = dict(f["parameters"])
        if params.get("type") == "object" and "additionalProperties" not in params:
            params["additionalProperties"] = False     # only the declared parameters
        variants.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                         "properties": {"name": {"const": f["name"]}, "arguments": params}})
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema = {**schema, "x-guidance": JSON_OPTIONS}
    return (f"start: {json.dumps(CALL_OPEN + chr(10))} call {json.dumps(chr(10) + CALL_CLOSE)}\n"
            f"call: %json {json.dumps(schema)}\n")


# ---- reading calls back ----

def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallReader:
    """Splits streamed model text into content and tool calls: push(text) and finish() return
    [("text", str) | ("call", {"id", "name", "arguments"})]. Text that might begin a <tool_call> is held
    back until it is clear. A block holds Qwen3's JSON call, or Qwen3-Coder's XML one (xml_call); one
    that parses as neither stays text. tools: the request's (the XML form's values are typed by their
    parameters' schemas)."""

    def __init__(self, tools: "ToolSpec | None" = None):
        self.buf, self.inside, self.num_calls = "", False, 0
        self.params = {f["name"]: (f.get("parameters") or {}).get("properties") or {}
                       for f in (tools.functions() if tools is not None else ())}

    def push(self, text: str) -> list[tuple[str, object]]:
        self.buf += text
        out = []
        while True:
            if not self.inside:
                clear, at = text_before(self.buf, CALL_OPEN)
                if clear:
                    out.append(("text", clear))
                self.buf = self.buf[len(clear):]
                if at < 0:
                    return out
                self.inside = True
            end = self.buf.find(CALL_CLOSE)
            if end < 0:
                return out
            block, self.buf, self.inside = self.buf[:end + len(CALL_CLOSE)], self.buf[end + len(CALL_CLOSE):], False
            out.append(self._call(block))

    def finish(self) -> list[tuple[str, object]]:
        rest, self.buf, self.inside = self.buf, "", False
        return [("text", rest)] if rest else []      # held-back text, or a call cut short by max_tokens

    def _call(self, block: str) -> tuple[str, object]:
        inner = block[len(CALL_OPEN):-len(CALL_CLOSE)]
        try:
            obj = json.loads(inner)
        except ValueError:
            obj = xml_call(inner, self.params)
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            return ("text", block)
        args = obj.get("arguments", {})
        self.num_calls += 1
        return ("call", {"id": new_call_id(), "name": obj["name"],
                         "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)})


_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]{1,64})>(.*)</function>\s*", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]{1,128})>(.*?)</parameter>", re.DOTALL)


def xml_call(inner: str, params: dict) -> dict | None:
    """Qwen3-Coder's call, `<function=NAME>` then `<parameter=KEY>VALUE</parameter>` blocks and
    `</function>`, as {"name", "arguments"}; None where the text is not one. Each value is a string
    (one newline after the opening tag and before the closing one belongs to the layout), typed by the
    parameter's schema: a string stays text, a number, boolean, object or array is read as JSON
    (text that is not stays text, as does every value of a parameter with no schema type)."""
    m = _XML_FUNCTION.fullmatch(inner)
    if m is None:
        return None
    name, body = m.group(1).strip(), m.group(2)
    schema = params.get(name, {})
    args = {}
    for key, raw in _XML_PARAMETER.findall(body):
        key = key.strip()
        value = raw[1:] if raw.startswith("\n") else raw
        value = value[:-1] if value.endswith("\n") else value
        kind = (schema.get(key) or {}).get("type") if isinstance(schema.get(key), dict) else None
        if kind in ("integer", "number", "boolean", "object", "array", "null"):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        args[key] = value
    if _XML_PARAMETER.sub("", body).strip():        # text besides the parameter blocks: not a call
        return None
    return {"name": name, "arguments": args}


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def text_before(buf: str, tag: str) -> tuple[str, int]:
    """(the text of streamed buf that surely comes before tag, where tag starts in buf or -1): with
    no tag yet, all of buf but a tail that could be its start (held back until the next text)."""
    at = buf.find(tag)
    if at >= 0:
        return buf[:at], at
    return buf[:len(buf) - _partial_suffix(buf, tag)], -1


def split_calls(text: str, tools: "ToolSpec | None" = None) -> tuple[str, list[dict]]:
    """(content, calls) of a finished reply (tools: the request's, for the XML form's value types)."""
    reader = ToolCallReader(tools)
    parts = reader.push(text) + reader.finish()
    content = "".join(p for k, p in parts if k == "text")
    return content, [p for k, p in parts if k == "call"]
