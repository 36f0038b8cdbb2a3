"""Structured output through the offline engine on the real SmolLM2: forks, a cramped KV pool and
prefix caching must not disturb a grammar's state, and every output validates."""

from __future__ import annotations

import json

import jsonschema
import pytest

from folio import LLM, SamplingParams
from folio.structured.params import StructuredOutputParams

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror", "sci-fi"]}, "maxItems": 2},
    },
    "required": ["title", "year", "genres"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a film as JSON with a title, a year and genres."}]


@pytest.fixture(scope="module")
def roomy(smollm2_gguf):
    return LLM(smollm2_gguf, kv_cache_memory="64MiB")


def _params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=120, structured_output=StructuredOutputParams(json=SCHEMA), **kwargs)


def test_forked_samples_each_follow_their_own_grammar(roomy):
    [out] = roomy.chat(ASK, _params(n=4, temperature=1.0, seed=3), use_tqdm=False)
    texts = [o.text for o in out.outputs]
    assert len(set(texts)) > 1  # really different samples, each validated on its own
    for o in out.outputs:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_preemption_and_prefix_caching_leave_the_grammar_intact(roomy, smollm2_gguf):
    """A preempted request recomputes its KV, not its grammar state: outputs equal a roomy run's."""
    cramped = LLM(smollm2_gguf, num_kv_blocks=12, block_size=16, max_num_batched_tokens=64)
    conversations = [[{"role": "user", "content": f"Describe film number {i} as JSON."}] for i in range(5)]
    params = _params(temperature=0.9, seed=11)
    got = cramped.chat(conversations, params, use_tqdm=False)
    expected = roomy.chat(conversations, params, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert sum(o.metrics.num_preemptions for o in got) > 0
    for o in got:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
