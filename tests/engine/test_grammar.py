"""Token masks from llguidance (strata.engine.grammar) and their use in the host sampler."""
import json

import numpy as np
import pytest

from strata.config import SamplingParams
from strata.engine.grammar import MAX_GRAMMAR_CHARS, GrammarCompiler, GrammarError
from strata.engine.sampler import mask_logits, pick_host

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")


def allowed_ids(mask: np.ndarray) -> np.ndarray:
    """The token ids a bitmask allows, read bit by bit (the slow, obvious way)."""
    return np.array([i for i in range(32 * mask.size) if (int(mask[i // 32]) >> (i % 32)) & 1], np.int64)


def test_mask_logits_keeps_exactly_the_allowed_tokens():
    rng = np.random.default_rng()
    for V in (1, 31, 32, 33, 1000, 8192):
        logits = rng.standard_normal(V).astype(np.float32)
        mask = rng.integers(-2**31, 2**31, (V + 31) // 32, dtype=np.int64).astype(np.int32)
        out = mask_logits(logits, mask)
        ok = np.zeros(V, bool)
        ok[allowed_ids(mask)[allowed_ids(mask) < V]] = True
        assert np.array_equal(out[ok], logits[ok]) and np.all(out[~ok] == -np.inf)


def test_pick_never_takes_a_masked_token():
    rng = np.random.default_rng()
    V = 300
    for trial in range(200):
        logits = (3 * rng.standard_normal(V)).astype(np.float32)
        keep = rng.choice(V, size=int(rng.integers(1, 6)), replace=False)
        bits = np.zeros(320, np.uint8)
        bits[keep] = 1
        mask = np.packbits(bits, bitorder="little").view(np.int32)
        p = SamplingParams(temperature=float(rng.choice([0.0, 0.7, 1.5])), top_k=int(rng.choice([0, 2, 50])),
                           top_p=float(rng.choice([1.0, 0.5])))
        token = pick_host(logits, p, float(rng.random()), mask)
        assert token in keep
        if p.temperature == 0.0:
            assert token == keep[np.argmax(logits[keep])]


@pytest.fixture(scope="module")
def compiler():
    from strata.engine.llm import DEMO_PACK
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(DEMO_PACK / "tokenizer.json"))
    # a model vocabulary past the tokenizer's: the padding ids must never be allowed
    return GrammarCompiler(tok.to_str(), 8192 + 64, tok.get_vocab_size(True), [2, 0]), tok


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "tags", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "n": {"type": "integer", "minimum": -5, "maximum": 500},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                         "kind": {"enum": ["module", "class", None]},
                         "opt": {"type": "integer", "minimum": 0, "maximum": 9}}}


def test_random_walks_through_the_mask_give_valid_json(compiler):
    """Tokens drawn uniformly from each mask (no model) always end in a document the schema accepts."""
    comp, tok = compiler
    grammar = comp.json_schema(SCHEMA)
    rng = np.random.default_rng()
    for walk in range(20):
        c, ids = grammar.constraint(), []
        while not c.complete:
            allowed = allowed_ids(c.mask())
            assert allowed.size and allowed.max() < tok.get_vocab_size(True)
            non_eos = allowed[~np.isin(allowed, [0, 2])]
            if non_eos.size == 0:
                break
            t = int(rng.choice(non_eos))
            c.advance(t)
            ids.append(t)
            assert len(ids) < 400
        doc = json.loads(tok.decode(ids))
        jsonschema.validate(doc, SCHEMA)


def test_json_object_mode_and_bad_grammars(compiler):
    comp, tok = compiler
    first = allowed_ids(comp.json_schema(None).constraint().mask())
    assert first.size and all(tok.decode([int(t)]).startswith("{") for t in first)
    with pytest.raises(GrammarError, match="at most"):
        comp.json_schema({"enum": ["x" * MAX_GRAMMAR_CHARS]})
    with pytest.raises(GrammarError):
        comp.json_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    with pytest.raises(GrammarError):
        comp.lark("start: undefined_rule")


HOSTILE = {
    "nested repeats": {"type": "string", "pattern": "^((a|b){1,200}){1,200}$"},
    "long strings": {"type": "string", "minLength": 100000, "maxLength": 200000},
    "counted array": {"type": "array", "items": {"type": "integer"}, "minItems": 5000, "maxItems": 100000},
    "deep nesting": json.loads('{"type": "array", "items": ' * 30 + '{"type": "integer"}' + "}" * 30),
    "many properties": {"type": "object", "required": [f"p{i}" for i in range(600)],
                        "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{3,9}x"} for i in range(600)}},
    "wide integers": {"type": "integer", "minimum": -10**15, "maximum": 10**15},
    "backtracking regex": {"type": "string", "pattern": "(x+x+)+y"},
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_schemas_compile_or_fail_fast(compiler, name):
    """Schemas from clients are untrusted: each compiles and gives its first masks, or is refused,
    in well under a second (llguidance's parser limits, PARSER_LIMITS)."""
    import time
    comp, _ = compiler
    t0 = time.perf_counter()
    try:
        c = comp.json_schema(HOSTILE[name]).constraint()
        for _ in range(8):          # a few steps along the grammar, each token the first allowed one
            allowed = allowed_ids(c.mask())
            assert allowed.size
            c.advance(int(allowed[-1]))
    except GrammarError:
        pass
    assert time.perf_counter() - t0 < 1.0
