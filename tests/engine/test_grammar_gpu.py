"""Structured output on the GPU: the demo model on CUDA, every pick under the schema's mask
(cuda/mask_logits.cu before argmax or sample.cu), greedy and seeded samples parse and validate."""
import json

import pytest

from strata.config import SamplingParams

pytestmark = pytest.mark.gpu
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "kind", "args"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                         "kind": {"enum": ["function", "class", "module"]},
                         "args": {"type": "integer", "minimum": 0, "maximum": 12}}}


def test_json_schema_on_the_gpu():
    import strata
    from strata.engine.grammar import compiler_for
    llm = strata.LLM(device="cuda")
    grammar = compiler_for(llm).json_schema(SCHEMA)
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe `json.dumps` as a JSON object."}]))
    texts = []
    for seed in [None, *range(30)]:
        params = SamplingParams(max_tokens=120, temperature=0.0 if seed is None else 1.0, seed=seed)
        gen = llm.begin(prompt, params, constraint=grammar.constraint())
        for _ in gen:
            pass
        assert gen.completion.finish_reason == "stop", gen.completion.text
        jsonschema.validate(json.loads(gen.completion.text), SCHEMA)
        texts.append(gen.completion.text)
    assert len(set(texts)) > 10
