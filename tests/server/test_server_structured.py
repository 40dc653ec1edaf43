"""response_format json_object / json_schema through the openai client, on the demo model: every
seeded sample parses and validates, because the grammar's token mask is applied before each pick."""
import json
import time

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "kind", "args", "pure"],
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "kind": {"enum": ["function", "class", "module"]},
        "args": {"type": "integer", "minimum": 0, "maximum": 12},
        "pure": {"type": "boolean"},
    },
}
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Describe `json.dumps` as a JSON object."}]


def test_json_schema_holds_in_100_of_100_seeded_samples(demo_client, demo_llm):
    """About 1-2 s a sample on a shared CPU core (about 25 tokens of the demo model): 2-3 minutes."""
    fmt = {"type": "json_schema", "json_schema": {"name": "symbol", "schema": SCHEMA, "strict": True}}
    docs, t0 = [], time.monotonic()
    for seed in range(100):
        r = demo_client.chat.completions.create(model=demo_llm.model_name, messages=MESSAGES, response_format=fmt,
                                                temperature=1.0, seed=seed, max_tokens=120)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (seed, text)
        doc = json.loads(text)
        jsonschema.validate(doc, SCHEMA)
        docs.append(text)
    assert len(set(docs)) > 50, "seeded sampling should give varied documents"
    print(f"100 samples in {time.monotonic() - t0:.0f} s")


def test_json_object_streams_the_same_object(demo_client, demo_llm):
    kw = dict(model=demo_llm.model_name, messages=MESSAGES, response_format={"type": "json_object"},
              temperature=0.8, seed=7, max_tokens=200)
    full = demo_client.chat.completions.create(**kw).choices[0]
    streamed = "".join(c.choices[0].delta.content or "" for c in demo_client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == full.message.content
    if full.finish_reason == "stop":         # else the object was cut at max_tokens
        assert isinstance(json.loads(full.message.content), dict)
    assert full.message.content.startswith("{")


def test_without_response_format_the_demo_writes_no_json(demo_client, demo_llm):
    """The mask does the work: unconstrained, the same seeds do not give schema-valid JSON."""
    valid = 0
    for seed in range(5):
        text = demo_client.chat.completions.create(model=demo_llm.model_name, messages=MESSAGES, temperature=1.0,
                                                   seed=seed, max_tokens=40).choices[0].message.content
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    assert valid == 0
