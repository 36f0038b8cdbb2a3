"""Beam search through the server (the `use_beam_search` / `beam_width` extension fields), compared
with the offline engine's beam search, which tests/oracle compares with transformers."""

from __future__ import annotations

import httpx
import pytest

from folio import SamplingParams
from tests.api.server_runner import MODEL

PROMPT = "The three most useful kitchen tools are"


def _beam_params(n: int, width: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=max_tokens, use_beam_search=True, beam_width=width)


def test_completion_beams_equal_the_offline_search(client, offline_llm):
    result = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=10,
                                       extra_body={"use_beam_search": True, "beam_width": 3})  # fmt: skip
    [offline] = offline_llm.generate(PROMPT, _beam_params(2, 3, 10), use_tqdm=False)
    assert [c.text for c in result.choices] == [o.text for o in offline.outputs]
    assert [c.finish_reason for c in result.choices] == [o.finish_reason for o in offline.outputs]
    assert result.choices[0].text != result.choices[1].text
    assert result.usage.completion_tokens == sum(len(o.token_ids) for o in offline.outputs)


def test_streamed_beams_arrive_whole_per_choice(client, offline_llm):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=8, stream=True,
                                       extra_body={"use_beam_search": True})  # fmt: skip
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    [offline] = offline_llm.generate(PROMPT, _beam_params(2, 2, 8), use_tqdm=False)
    assert texts == [o.text for o in offline.outputs]


def test_chat_beam_search(client, offline_llm):
    messages = [{"role": "user", "content": "Name a colour."}]
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                            extra_body={"use_beam_search": True, "beam_width": 4})  # fmt: skip
    [offline] = offline_llm.chat(messages, _beam_params(1, 4, 8), use_tqdm=False)
    assert result.choices[0].message.content == offline.outputs[0].text


@pytest.mark.parametrize(
    "extra",
    [
        {"beam_width": 2},  # without use_beam_search
        {"use_beam_search": True, "beam_width": 1, "n": 2},
        {"use_beam_search": True, "presence_penalty": 0.5},
        {"use_beam_search": True, "stop": ["."]},
        {"use_beam_search": True, "logprobs": 2},
        {"use_beam_search": True, "best_of": 2},
        {"use_beam_search": True, "early_stopping": "sometimes"},
    ],
)
def test_unsupported_beam_search_combinations_are_400(base_url, client, extra):
    response = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "hi", **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=1).usage.completion_tokens == 1
