"""A server with prompt-lookup speculation answers the official client exactly as the plain server does
(streamed too), reports drafted and accepted tokens at /metrics under vLLM's names, and lets a request
opt out."""

from __future__ import annotations

import re

import httpx
import openai

from folio import LLM
from tests.api.server_runner import MODEL, running_server

PROMPT = (
    "Repeat the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape.\nRepeated: apple, banana,"
)


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^folio:{name}(?:_total)?{{[^}}]*}} ([0-9.e+]+)$", text, re.MULTILINE)
    assert found, name
    return float(found.group(1))


def test_speculating_server_matches_the_plain_server(client, smollm2_gguf):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, logprobs=1)
    plain = client.completions.create(**kwargs).choices[0]
    llm = LLM(smollm2_gguf, kv_cache_memory="64MiB", speculative_config={"num_speculative_tokens": 4})
    with running_server(llm, MODEL) as (url, _):
        fast_client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        fast = fast_client.completions.create(**kwargs).choices[0]
        streamed = "".join(c.choices[0].text for c in fast_client.completions.create(stream=True, **kwargs))
        metrics = httpx.get(f"{url}/metrics").text
        # folio's `speculate: false` opts one request out: same text, not one more draft.
        opted_out = fast_client.completions.create(extra_body={"speculate": False}, **kwargs).choices[0]
        assert opted_out.text == plain.text
        after = httpx.get(f"{url}/metrics").text
    assert fast.text == plain.text == streamed
    assert fast.logprobs.tokens == plain.logprobs.tokens
    drafted, accepted = (
        _metric(metrics, "spec_decode_num_draft_tokens"),
        _metric(metrics, "spec_decode_num_accepted_tokens"),
    )
    assert 0 < accepted <= drafted and _metric(metrics, "spec_decode_num_drafts") > 0
    assert 'folio:spec_decode_num_accepted_tokens_per_pos_total{model_name="smollm2-135m",position="0"}' in metrics
    assert _metric(after, "spec_decode_num_draft_tokens") == drafted
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks
