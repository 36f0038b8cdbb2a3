"""Prompt logprobs through the API: `echo` with `logprobs` returns the prompt's tokens and logprobs before
the completion's, as OpenAI's legacy completions did (what loglikelihood evaluations read), and vLLM's
`prompt_logprobs` extension; both equal the offline engine's prompt_logprobs, streamed or whole."""

from __future__ import annotations

import math

import pytest

from folio import SamplingParams
from tests.api.server_runner import MODEL

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def offline_scores(offline_llm):
    out = offline_llm.generate(PROMPT, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2), use_tqdm=False)
    return out[0]


def test_echo_with_logprobs_returns_the_prompt_tokens_first(client, offline_scores):
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2)
    choice = result.choices[0]
    num_prompt = len(offline_scores.prompt_token_ids)
    assert choice.text == PROMPT + offline_scores.text
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == num_prompt + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts it
    expected = [lp.logprob for lp in offline_scores.prompt_logprobs[1:]]
    assert logprobs.token_logprobs[1:num_prompt] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) == 2 for top in logprobs.top_logprobs[1:])
    assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_echo_with_logprobs_streams_the_same(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1)
    whole = client.completions.create(**kwargs).choices[0]
    text, tokens, token_logprobs = "", [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                token_logprobs += choice.logprobs.token_logprobs
    assert text == whole.text and tokens == whole.logprobs.tokens
    assert token_logprobs[0] is None and token_logprobs[1:] == pytest.approx(whole.logprobs.token_logprobs[1:])


def test_vllm_prompt_logprobs_field(client, offline_scores):
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, n=2,
                                       extra_body={"prompt_logprobs": 1})  # fmt: skip
    for choice in result.choices:  # the second sample forked the first's prompt: the same scores
        scores = choice.model_extra["prompt_logprobs"]
        assert scores[0] is None and len(scores) == len(offline_scores.prompt_token_ids)
        for token_id, entry, offline in zip(offline_scores.prompt_token_ids[1:], scores[1:],
                                            offline_scores.prompt_logprobs[1:], strict=True):  # fmt: skip
            assert entry[str(token_id)]["logprob"] == pytest.approx(offline.logprob, abs=1e-4)
            assert 1 <= len(entry) <= 2
