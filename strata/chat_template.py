"""Chat templates from model files, rendered with a budget.

A template comes with the model, so it is untrusted code: jinja2's ImmutableSandboxedEnvironment
stops it reaching Python internals, but not from looping for ever (two nested 100,000-step loops)
or building a string of gigabytes ("x" * 10**10, a doubling namespace variable, "{:>999999999}").
Every render therefore runs under a Budget: each loop iteration, call and filter costs a step; the
steps, the wall time and the size of every string or list the template builds are capped; widths
and repeat counts are checked before the operation allocates. Exceeding any of them raises
ChatTemplateBudget (an InvalidArgument, so a server answers it as a 400 naming the template).
"""
from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from dataclasses import dataclass

from jinja2 import Template, nodes
from jinja2.visitor import NodeTransformer
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import InvalidArgument

MAX_STEPS = 1_000_000            # a real template takes ~20 steps a message; the nested-loop attack, 10^10
MAX_SECONDS = 1.0
MAX_OUTPUT_CHARS = 8 << 20       # above what a 4 MiB request body renders to, so only a runaway hits it
MAX_BUILT_CHARS = 8 * MAX_OUTPUT_CHARS    # all strings and lists built in one render (loops append to buffers)
MAX_INT_BITS = 1 << 16
_HUGE_WIDTH = re.compile(r"\d{8,}")     # a field width in a format string that alone passes the output cap


class ChatTemplateError(InvalidArgument):
    """The model's chat template fails on these messages."""


class ChatTemplateBudget(ChatTemplateError):
    """The model's chat template ran past its step, time or size budget."""


@dataclass
class Budget:
    max_steps: int = MAX_STEPS
    max_seconds: float = MAX_SECONDS
    max_chars: int = MAX_OUTPUT_CHARS
    max_built: int = MAX_BUILT_CHARS
    steps: int = 0
    built: int = 0
    deadline: float = 0.0

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.max_steps:
            raise ChatTemplateBudget(f"chat template: stopped after {self.max_steps:,} steps (loop iterations "
                                     f"and calls); the model's template loops too much for these messages")
        if time.monotonic() > self.deadline:
            raise ChatTemplateBudget(f"chat template: stopped after {self.max_seconds:g} s; the model's "
                                     f"template runs too long for these messages")

    def count(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise ChatTemplateBudget(f"chat template: {what} of {n:,} items passes the limit of {self.max_chars:,}")

    def size(self, value, what: str = "a value"):
        """value, if it is no bigger than the caps allow (checked after an operation that cannot amplify much)."""
        if isinstance(value, (str, list, tuple, bytes, dict)):
            self.count(len(value), what)
            self.built += len(value)
            if self.built > self.max_built:
                raise ChatTemplateBudget(f"chat template: built more than {self.max_built:,} characters and items "
                                         f"in all; the model's template builds too much for these messages")
        elif isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise ChatTemplateBudget(f"chat template: {what} is an integer of more than {MAX_INT_BITS} bits")
        return value

    def width(self, args) -> None:
        """Integer arguments are widths or repeat counts here, and format strings carry widths: one past
        the cap would allocate past it before any result could be checked."""
        for a in args:
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.max_chars:
                raise ChatTemplateBudget(f"chat template: a width or count of {a:,} passes the limit of "
                                         f"{self.max_chars:,}")
            if isinstance(a, str) and ("%" in a or "{" in a) and _HUGE_WIDTH.search(a):
                raise ChatTemplateBudget("chat template: a format string's field width passes the limit of "
                                         f"{self.max_chars:,}")


_budget: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("strata_chat_budget", default=None)


def _current() -> Budget:
    b = _budget.get()
    # None only outside Template.render (a template's generate(), say): that call alone is bounded
    return b if b is not None else Budget(deadline=time.monotonic() + MAX_SECONDS)


class BudgetedTemplate(Template):
    def render(self, *args, **kwargs) -> str:
        """Template.render under the default budget, unless render() below set one."""
        token = _budget.set(Budget(deadline=time.monotonic() + MAX_SECONDS)) if _budget.get() is None else None
        try:
            return super().render(*args, **kwargs)
        finally:
            if token is not None:
                _budget.reset(token)


def _estimate_replace(s, old, new, count=-1) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    n = s.count(old) if old else len(s) + 1
    if count is not None and count >= 0:
        n = min(n, count)
    return len(s) + n * (len(new) - len(old))


def _estimate_join(sep, items) -> int:
    if isinstance(sep, str) and hasattr(items, "__len__"):
        return len(sep) * max(0, len(items) - 1)
    return 0


def _budget_iter(iterable):
    """Wrapped around every for loop's iterable: one step per iteration."""
    b = _current()
    for item in iterable:
        b.step()
        yield item


def _checked_filter(name: str, f):
    special = 0 if getattr(f, "jinja_pass_arg", None) is None else 1    # context/env/eval_ctx comes first

    @functools.wraps(f)     # keeps jinja's pass_context/pass_environment mark
    def run(*args, **kwargs):
        b = _current()
        b.step()
        head, rest = args[:special], list(args[special:])
        # rest[0] is the value filtered; a big number there is no width
        b.width([*(rest if name == "format" else rest[1:]), *kwargs.values()])
        if name == "replace" and len(rest) >= 3:
            b.count(_estimate_replace(*rest[:4]), "replace's result")
        if name == "join" and rest:
            if not hasattr(rest[0], "__len__"):
                rest[0] = b.size(list(rest[0]), "join's items")
            sep = rest[1] if len(rest) > 1 else kwargs.get("d", "")
            b.count(_estimate_join(sep, rest[0]), "join's result")
        return b.size(f(*head, *rest, **kwargs), f"the result of |{name}")
    return run


class _Transform(NodeTransformer):
    """Every loop's iterable through _budget_iter; every `~` through the checked join."""

    def visit_For(self, node: nodes.For):
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "strata_budget_iter", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat):
        self.generic_visit(node)
        return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), "strata_budget_concat", [], [], None,
                            None, lineno=node.lineno)


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with HF's whitespace rules and every render step, call and string counted."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})
    template_class = BudgetedTemplate

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        self.filters = {name: _checked_filter(name, f) for name, f in self.filters.items()}
        self.filters["strata_budget_iter"] = _budget_iter
        self.filters["strata_budget_concat"] = lambda parts: self.concat(map(str, parts))

    def _parse(self, source, name, filename):
        return _Transform().visit(super()._parse(source, name, filename))

    def concat(self, parts) -> str:
        """Every buffer jinja joins (the output, macros, set blocks) is counted as it grows."""
        b, total, out = _current(), 0, []
        for p in parts:
            total += len(p)
            if total > b.max_chars:
                raise ChatTemplateBudget(f"chat template: its output passes the limit of {b.max_chars:,} characters")
            out.append(p)
        return "".join(out)

    def call_binop(self, context, op, left, right):
        b = _current()
        b.step()
        sized = lambda v: isinstance(v, (str, list, tuple))
        is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
        if op == "*" and (sized(left) and is_int(right) or is_int(left) and sized(right)):
            seq, n = (left, right) if sized(left) else (right, left)
            b.count(len(seq) * max(n, 0), "a repeated value")
        elif op == "*" and is_int(left) and is_int(right):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise ChatTemplateBudget(f"chat template: a product of more than {MAX_INT_BITS} bits")
        elif op == "+" and sized(left) and sized(right):
            b.count(len(left) + len(right), "a concatenation")
        elif op == "**" and is_int(left) and is_int(right) and right > 0:
            if max(abs(left), 2).bit_length() * right > MAX_INT_BITS:
                raise ChatTemplateBudget(f"chat template: a power of more than {MAX_INT_BITS} bits")
        elif op == "%" and isinstance(left, str):
            b.width([left, *(right if isinstance(right, tuple) else (right,))])
        return b.size(super().call_binop(context, op, left, right), "the result of an operator")

    def call(__self, __context, __obj, *args, **kwargs):    # noqa: N805 (jinja's own signature)
        b = _current()
        b.step()
        b.width([*args, *kwargs.values()])
        target = getattr(__obj, "__wrapped__", __obj)     # the sandbox wraps str.format
        if isinstance(getattr(target, "__self__", None), str):
            s, fname = target.__self__, getattr(target, "__name__", "")
            if fname in ("format", "format_map"):
                b.width([s])
            elif fname == "replace":
                b.count(_estimate_replace(s, *args[:3]), "replace's result")
            elif fname == "join" and args:
                items = args[0] if hasattr(args[0], "__len__") else b.size(list(args[0]), "join's items")
                b.count(_estimate_join(s, items), "join's result")
                args = (items, *args[1:])
        return b.size(super().call(__context, __obj, *args, **kwargs), "a call's result")


MAX_JSON_INDENT = 16


def _json_depth(value) -> int:
    depth, level = 0, [value]
    while level:
        depth += 1
        level = [x for v in level if isinstance(v, (dict, list, tuple))
                 for x in (v.values() if isinstance(v, dict) else v)]
    return depth


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """tojson as Hugging Face's chat templates have it: plain json.dumps, keys in their order, no HTML
    escaping. (jinja2's own sorts keys and escapes <, >, & and ', which is not how a model trained
    with HF's templates saw its tools.) An indent multiplies the size, so it is capped and priced first."""
    if indent is not None and (isinstance(indent, bool) or not isinstance(indent, int)
                               or not 0 <= indent <= MAX_JSON_INDENT):
        raise ChatTemplateBudget(f"chat template: tojson's indent must be 0 to {MAX_JSON_INDENT}, got {indent!r}")
    compact = json.dumps(value, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
    if not indent:
        return compact
    _current().count(len(compact) * (1 + indent * _json_depth(value)), "tojson's indented result")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise ChatTemplateError(f"chat template: {message}")


@functools.lru_cache(maxsize=1)
def environment() -> BudgetedEnvironment:
    env = BudgetedEnvironment()
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _checked_filter("tojson", _tojson)
    return env


def compile_template(source: str):
    """The compiled template (jinja2's TemplateSyntaxError, or RecursionError past Python's stack,
    propagate: the caller says whose template it was)."""
    return environment().from_string(source)


def render(template, budget: Budget | None = None, **variables) -> str:
    """template.render(**variables) under `budget` (the default caps: MAX_STEPS, MAX_SECONDS,
    MAX_OUTPUT_CHARS). ChatTemplateBudget past a cap; ChatTemplateError when the template fails."""
    budget = budget or Budget()
    budget.deadline = time.monotonic() + budget.max_seconds
    token = _budget.set(budget)
    try:
        return template.render(**variables)
    except ChatTemplateError:
        raise
    except RecursionError:
        raise ChatTemplateBudget("chat template: recursion too deep for these messages") from None
    except MemoryError:
        raise ChatTemplateBudget("chat template: ran out of memory on these messages") from None
    except Exception as e:  # jinja2's TemplateError, or whatever the template's own code raised
        raise ChatTemplateError(f"chat template: fails on these messages ({type(e).__name__}: "
                                f"{str(e)[:200]})") from None
    finally:
        _budget.reset(token)
