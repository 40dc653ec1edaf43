"""CudaRunner.pick with a token mask (cuda/mask_logits.cu, emulated) against the host pick with the
same mask: only allowed tokens, the same token on every draw not within 1e-5 of a boundary."""
import numpy as np
import pytest

from strata.backends.cuda.sample import sample_reference
from strata.config import SamplingParams
from strata.engine.cuda_runner import CudaRunner
from strata.engine.llm import demo_model_path
from strata.engine.sampler import mask_logits, pick_host
from strata.errors import InvalidArgument
from strata.pack import open_pack


def test_masked_pick_on_the_device_equals_the_host_pick(fake, rng):
    pack = open_pack(demo_model_path())
    V = pack.args.vocab_size
    runner = CudaRunner(pack, 64)
    ids = rng.integers(0, V, 7).tolist()
    logits = runner.prefill(ids, 0)
    for params in (SamplingParams(), SamplingParams(temperature=0.9, top_k=20, top_p=0.9)):
        for _ in range(6):
            bits = (rng.random(32 * ((V + 31) // 32)) < 0.02).astype(np.uint8)
            mask = np.packbits(bits, bitorder="little").view(np.int32)
            u = float(rng.random())
            masked = mask_logits(logits, mask)
            _, _, margin = sample_reference(masked[None], params.temperature, params.top_k, params.top_p, u,
                                            margins=True)
            runner.prefill(ids, len(ids) - 1)        # fresh device logits: the mask is applied in place
            token = runner.pick(params, u, mask=mask)
            assert bits[token]
            if margin[0] > 1e-5:
                assert token == pick_host(logits, params, u, mask)
    assert "strata_mask_logits_f32" in fake.launches
    with pytest.raises(InvalidArgument, match="32-bit words"):
        runner.pick(SamplingParams(), 0.5, mask=np.zeros(3, np.int32))


def test_structured_generation_through_the_emulated_device(fake):
    """The generation loop on the GPU runner (emulated): a json_schema reply that validates, every pick
    after a mask launch, and the same greedy tokens as the CPU with the same grammar."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    from strata.engine import llm as llm_module
    from strata.engine.grammar import compiler_for
    schema = {"type": "object", "additionalProperties": False, "required": ["kind", "args"],
              "properties": {"kind": {"enum": ["function", "class"]}, "args": {"type": "integer", "maximum": 99}}}
    outs = []
    for device in ("cuda", "cpu"):
        llm = llm_module.LLM(device=device)
        gen = llm.begin("Describe json.dumps:", SamplingParams(max_tokens=40),
                        constraint=compiler_for(llm).json_schema(schema).constraint())
        for _ in gen:
            pass
        jsonschema.validate(json.loads(gen.completion.text), schema)
        outs.append(gen.completion.token_ids)
    assert fake.launches.count("strata_mask_logits_f32") == len(outs[0])
    assert outs[0] == outs[1]
