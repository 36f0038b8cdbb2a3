"""The offline API on the real SmolLM2 model: batching, seeds, finish reasons, timings, chat."""

from __future__ import annotations

import pytest

from folio import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    return LLM(smollm2_gguf, kv_cache_memory="256MiB", max_num_batched_tokens=64)


def test_batched_greedy_equals_one_at_a_time(llm):
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    assert together == alone


def test_same_seed_same_text_and_different_seed_differs(llm):
    # EOS is this prompt's likeliest first token (p 0.45): ignored, so that two seeds' texts can differ.
    params = lambda seed: SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)  # noqa: E731
    first = llm.generate(["Tell me a story about a cat."], params(1))[0].text
    # The same seeded request, this time batched with unseeded neighbours.
    batch = llm.generate(["Hello", "Tell me a story about a cat.", "Hi"], [params(None), params(1), params(None)])
    assert batch[1].text == first
    assert llm.generate(["Tell me a story about a cat."], params(2))[0].text != first


def test_finish_reasons_and_timings(llm):
    [out] = llm.generate(["Count: 1, 2, 3,"], SamplingParams(max_tokens=5, temperature=0))
    completion = out.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 5
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finish_time
    assert completion.text == llm.tokenizer.decode(completion.token_ids)

    [chat] = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=200, temperature=0))
    assert chat.outputs[0].finish_reason == "stop"  # the model ends its turn
    assert chat.outputs[0].token_ids[-1] in llm.model_config.eos_token_ids

    [stopped] = llm.generate(["1, 2, 3,"], SamplingParams(max_tokens=50, temperature=0, stop_token_ids=[28]))
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].token_ids[-1] == 28


def test_streaming_yields_the_same_text(llm):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    streamed = "".join(llm.stream("The best thing about Paris is", params))
    assert streamed == llm.generate("The best thing about Paris is", params)[0].text


def test_bad_prompts_are_rejected_and_nothing_leaks(llm):
    free = llm.engine.kv.pool.num_free_blocks
    with pytest.raises(ValueError, match="context length"):
        llm.generate([[5] * (llm.engine.max_model_len + 1)], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", [], "also fine"], SamplingParams(max_tokens=1))  # the good ones are withdrawn too
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    assert llm.engine.kv.pool.num_free_blocks == free and not llm.engine.has_unfinished()
