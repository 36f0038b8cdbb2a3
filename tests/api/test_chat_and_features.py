"""Chat completions and the request features (n, stop, logprobs, penalties, echo, several prompts),
driven through the official openai client against the real SmolLM2 server."""

from __future__ import annotations

import math

import httpx
import pytest

from folio import SamplingParams
from tests.api.server_runner import MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_matches_offline_chat_and_counts_usage(client, base_url, offline_llm):
    result = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    offline = offline_llm.chat(QUESTION, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0]
    choice = result.choices[0]
    assert result.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == offline.text and "Paris" in offline.text
    assert choice.finish_reason == offline.outputs[0].finish_reason
    prompt = httpx.post(f"{base_url}/tokenize", json={"messages": QUESTION}).json()
    assert result.usage.prompt_tokens == prompt["count"] == len(offline.prompt_token_ids)
    assert result.usage.completion_tokens == len(offline.outputs[0].token_ids)


def test_chat_streaming_framing_and_usage(client):
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_sse_wire_format(base_url):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_n_choices_differ_and_are_reproducible(client):
    kwargs = dict(model=MODEL, prompt="My favourite food is", max_tokens=12, temperature=1.0, n=3, seed=11,
                  extra_body={"ignore_eos": True})  # fmt: skip
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2] and texts == [c.text for c in second.choices]
    assert len(set(texts)) > 1
    assert first.usage.completion_tokens == 3 * 12 and first.usage.prompt_tokens == 4  # counted once


def test_streamed_n_choices_join_per_index(client):
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=10, temperature=0.8, n=2, seed=3)
    whole = client.chat.completions.create(**kwargs)
    texts = ["", ""]
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in whole.choices]


def test_several_prompts_and_echo(client, base_url):
    prompts = ["The capital of France is", "1, 2, 3,"]
    result = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2, echo=True)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    for choice in result.choices:
        assert choice.text.startswith(prompts[choice.index // 2])
    alone = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=5, temperature=0)
    assert result.choices[3].text == prompts[1] + alone.choices[0].text
    counts = [httpx.post(f"{base_url}/tokenize", json={"prompt": p}).json()["count"] for p in prompts]
    assert result.usage.prompt_tokens == sum(counts)  # each prompt counted once, whatever n is
    assert result.usage.completion_tokens == 4 * 5


def test_stop_strings_cut_the_text(client):
    kwargs = dict(model=MODEL, prompt="1, 2, 3,", max_tokens=20, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    assert " 7," in plain
    stopped = client.completions.create(stop=[" 7,", "never"], **kwargs).choices[0]
    assert stopped.text == plain[: plain.index(" 7,")] and stopped.finish_reason == "stop"
    streamed = list(client.completions.create(stop=" 7,", stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed) == stopped.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs_are_consistent(client):
    result = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0, logprobs=3)
    logprobs = result.choices[0].logprobs
    assert "".join(logprobs.tokens) == result.choices[0].text
    assert len(logprobs.token_logprobs) == result.usage.completion_tokens == 6
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) == 3 and value <= 0
        assert math.isclose(top[token], value) and math.isclose(max(top.values()), value)  # greedy takes the best
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]


def test_chat_logprobs_count_every_token(client):
    result = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    assert all(len(item.top_logprobs) == 2 and item.top_logprobs[0].token == item.token for item in content)
    assert all(bytes(item.bytes) == item.token.encode() for item in content)


def test_penalties_change_greedy_output_like_the_offline_engine(client, offline_llm):
    kwargs = dict(model=MODEL, prompt="1, 2, 1, 2, 1, 2,", max_tokens=12, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    penalised = client.completions.create(frequency_penalty=2.0, presence_penalty=1.0, **kwargs).choices[0].text
    repeated = client.completions.create(extra_body={"repetition_penalty": 1.5}, **kwargs).choices[0].text
    assert penalised != plain and repeated != plain
    offline = offline_llm.generate(
        kwargs["prompt"],
        SamplingParams(max_tokens=12, temperature=0, frequency_penalty=2.0, presence_penalty=1.0),
        use_tqdm=False,
    )
    assert offline[0].text == penalised


def test_tokenize_detokenize_round_trip(base_url):
    tokens = httpx.post(f"{base_url}/tokenize", json={"prompt": "Hello, world!"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > 0
    assert httpx.post(f"{base_url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello, world!"}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "tools": [{"type": "function"}]}, "tools"),
        ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "response_format": {"type": "json"}},
         "response_format"),
        ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "top_logprobs": 2}, None),
        ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "n": 0}, "n"),
        ("/v1/chat/completions", {"model": "gpt-4", "messages": QUESTION}, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"five": 10}}, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 1, "n": 2}, None),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 3, "stream": True}, None),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "bogus": 1}, "bogus"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "frequency_penalty": 3}, "frequency_penalty"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": [""]}, None),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, None),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": ""}, None),
        ("/v1/completions", {"model": MODEL, "prompt": [10**7]}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/tokenize", {}, None),
    ],
)  # fmt: skip
def test_bad_requests_are_400_and_name_the_parameter(base_url, client, path, body, param):
    response = httpx.post(f"{base_url}{path}", json=body)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param or (error["param"] or "").startswith(param), error
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=1).usage.completion_tokens == 1


def test_logit_bias_forces_and_bans_tokens(client, base_url):
    banana = httpx.post(f"{base_url}/tokenize", json={"prompt": " banana"}).json()["tokens"]
    assert len(banana) == 1
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    forced = client.completions.create(logit_bias={str(banana[0]): 100}, **kwargs).choices[0].text
    assert forced == " banana" * 4
    plain = client.completions.create(**kwargs).choices[0].text
    first = httpx.post(f"{base_url}/tokenize", json={"prompt": plain}).json()["tokens"][0]
    banned = client.completions.create(logit_bias={str(first): -100}, **kwargs).choices[0]
    assert httpx.post(f"{base_url}/tokenize", json={"prompt": banned.text}).json()["tokens"][0] != first


def test_best_of_returns_the_most_likely_samples(client):
    kwargs = dict(model=MODEL, prompt="My favourite colour is", max_tokens=6, temperature=1.0, seed=21,
                  extra_body={"ignore_eos": True})  # fmt: skip
    every = client.completions.create(n=4, logprobs=0, **kwargs)
    ranked = sorted(every.choices, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    best = client.completions.create(n=2, best_of=4, **kwargs)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 4 * 6  # every sample counts
