"""Constrained decoding: token masks from a grammar, through llguidance.

A Grammar is compiled once per request from a JSON schema or a Lark grammar (llguidance's own
format, which embeds JSON schemas with `%json`); a TokenConstraint follows one generation: before
each pick it gives the bitmask of the tokens the grammar allows next (int32 words, bit i of word
i // 32 is token i, llguidance's layout), and after it is told the token that was picked. The mask
is applied to the logits before argmax or sampling (engine/sampler.py on the host, cuda/mask_logits.cu
on the device). Once the grammar is complete only the end-of-sequence tokens stay allowed.

Why llguidance (over xgrammar): its masks cost 10-20 us a token on the demo's 8192-token vocabulary
(xgrammar 2-4 us; both far below a decode step; tools/grammar_mask_bench.py), it has no runtime
dependency on torch, and its parser limits bound the work an untrusted schema can cause at compile
time and at every step.
Grammars come from clients, so their size is capped here and llguidance runs under those limits.
"""
from __future__ import annotations

import json
import threading
import weakref

import numpy as np

from ..errors import InvalidArgument, StrataError

MAX_GRAMMAR_CHARS = 64 << 10     # a schema or Lark text from a request; real ones are a few KiB
# llguidance's parser limits, tighter than its defaults (which allow ~100 ms of lexer work up front)
PARSER_LIMITS = dict(max_items_in_row=500, initial_lexer_fuel=500_000, step_lexer_fuel=200_000,
                     step_max_items=50_000, max_lexer_states=50_000, max_grammar_size=100_000)
# JSON output with no free whitespace: a small model cannot spend its tokens on spaces and newlines
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(InvalidArgument):
    """A grammar or schema llguidance cannot compile, or one past the size and work limits."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise StrataError("structured output needs the llguidance package (pip install llguidance)") from None
    return llguidance


class Grammar:
    """A compiled grammar for one tokenizer; constraint() starts a fresh matcher over it."""

    def __init__(self, compiler: "GrammarCompiler", spec: str, what: str):
        self.compiler, self.spec, self.what = compiler, spec, what
        self._first = compiler.matcher(spec, what)    # compiled now, so a bad grammar fails the request early

    def constraint(self) -> "TokenConstraint":
        matcher, self._first = self._first or self.compiler.matcher(self.spec, self.what), None
        return TokenConstraint(matcher, self.compiler.num_words, self.compiler.tokenizer_vocab)


class TokenConstraint:
    """The grammar's state along one generation: mask() before a pick, advance(token) after it."""

    def __init__(self, matcher, num_words: int, tokenizer_vocab: int):
        self.matcher = matcher
        self._mask = np.zeros(num_words, np.int32)
        # ids past the tokenizer's (the model's padding rows) are never allowed
        self._known = _bits_below(tokenizer_vocab, num_words)

    def mask(self) -> np.ndarray:
        """The allowed next tokens: int32 [ceil(V / 32)], bit i of word i // 32 for token i."""
        self.matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        if self.matcher.is_error():     # a step past the parser limits
            raise StrataError(f"structured output: the grammar failed at this step ({self.matcher.get_error()})")
        np.bitwise_and(self._mask, self._known, out=self._mask)
        return self._mask

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise StrataError(f"structured output: token {token} was not allowed by the grammar "
                              f"({self.matcher.get_error()})")

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and allows nothing more but end-of-sequence."""
        return self.matcher.is_stopped()


class GrammarCompiler:
    """llguidance's view of one tokenizer (built once, ~50 ms for 8192 tokens) and its compiles."""

    def __init__(self, tokenizer_json: str, model_vocab: int, tokenizer_vocab: int, eos_token_ids: list[int]):
        llg = _llguidance()
        self.num_words = (model_vocab + 31) // 32
        self.tokenizer_vocab = tokenizer_vocab
        try:
            self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=model_vocab, eos_token=list(eos_token_ids) or None)
        except Exception as e:      # a tokenizer.json llguidance does not understand: no structured output for it
            raise StrataError(f"structured output: llguidance cannot read this model's tokenizer "
                              f"({str(e)[:200]})") from None
        self.limits = llg.LLParserLimits(**PARSER_LIMITS)

    def matcher(self, spec: str, what: str):
        llg = _llguidance()
        m = llg.LLMatcher(self.tokenizer, spec, log_level=0, limits=self.limits)
        if m.is_error():
            raise GrammarError(f"{what}: {m.get_error()[:300]}")
        return m

    def json_schema(self, schema: dict | None, what: str = "the JSON schema") -> Grammar:
        """Any JSON object when schema is None (response_format json_object), else one that validates."""
        body = {"type": "object"} if schema is None else schema
        text = _bounded(json.dumps(body), what)
        try:
            spec = _llguidance().LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"{what}: {str(e)[:300]}") from None
        return Grammar(self, spec, what)

    def lark(self, text: str, what: str = "the grammar") -> Grammar:
        """A Lark grammar in llguidance's dialect (`%json {...}` embeds a JSON schema)."""
        return Grammar(self, _llguidance().LLMatcher.grammar_from_lark(_bounded(text, what)), what)


def _bits_below(n: int, num_words: int) -> np.ndarray:
    """The bitmask (int32 words) with bits 0..n-1 set."""
    bits = np.zeros(num_words * 32, np.uint8)
    bits[:n] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def _bounded(text: str, what: str) -> str:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{what} is {len(text):,} characters; at most {MAX_GRAMMAR_CHARS:,} are accepted")
    return text


_lock = threading.Lock()
_compilers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # Tokenizer -> GrammarCompiler


def compiler_for(llm) -> GrammarCompiler:
    """The GrammarCompiler of a loaded LLM's tokenizer (made at its first structured request, then kept)."""
    tok = llm.tokenizer
    with _lock:
        compiler = _compilers.get(tok)
        if compiler is None:
            compiler = _compilers[tok] = GrammarCompiler(tok.to_json(), llm.args.vocab_size, tok.vocab_size,
                                                         tok.eos_token_ids)
    return compiler
