"""Logprobs and penalties through the whole engine (LLM.generate) against transformers on a tiny
random-init model, and stop strings on the real SmolLM2 model."""

from __future__ import annotations

import pytest
import torch

from folio import LLM, SamplingParams
from tests.reference import reference_greedy
from tests.tiny_models import VOCAB, make_tiny_model

transformers = pytest.importorskip("transformers")

STEPS = 24
TOLERANCE = 1e-4  # fp32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    llm = LLM(folder, num_kv_blocks=256, block_size=4, max_num_batched_tokens=1024)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return llm, reference


def _prompt(seed: int, length: int = 12) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_logprobs_match(logprobs, token_ids, ref_logits: torch.Tensor, k: int) -> None:
    """ref_logits[i] are transformers' raw logits at the step that produced token_ids[i]."""
    assert len(logprobs) == len(token_ids) == len(ref_logits)
    ref = torch.log_softmax(ref_logits.double(), dim=-1)
    for lp, token, row in zip(logprobs, token_ids, ref, strict=True):
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(float(row[token]), abs=TOLERANCE)
        best = row.topk(k)
        assert [t for t, _ in lp.top] == best.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(best.values.tolist(), abs=TOLERANCE)


def test_greedy_logprobs_equal_transformers(tiny):
    llm, reference = tiny
    prompts = [_prompt(1), _prompt(2, 30)]
    params = [
        SamplingParams(max_tokens=STEPS, temperature=0, logprobs=5),
        SamplingParams(max_tokens=STEPS, temperature=0),
    ]
    with_lp, without = llm.generate(prompts, params, use_tqdm=False)
    assert without.outputs[0].logprobs is None  # a neighbour that asked for none gets none
    out = with_lp.outputs[0]
    ref_tokens, ref_logits = reference_greedy(reference, prompts[0], STEPS)
    assert out.token_ids == ref_tokens
    _assert_logprobs_match(out.logprobs, out.token_ids, ref_logits[len(prompts[0]) - 1 :], 5)


def test_sampled_logprobs_are_the_raw_model_distribution(tiny):
    """Sampling with temperature and a repetition penalty: the logprobs still describe the model's raw
    logits, which transformers gives for the generated sequence in one teacher-forced forward."""
    llm, reference = tiny
    prompt = _prompt(3)
    params = SamplingParams(max_tokens=STEPS, temperature=1.3, top_k=50, repetition_penalty=1.3, seed=0, logprobs=3)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + out.token_ids])).logits[0]
    _assert_logprobs_match(out.logprobs, out.token_ids, logits[len(prompt) - 1 : -1], 3)


def test_greedy_repetition_penalty_equals_transformers_generate(tiny):
    llm, reference = tiny
    prompt = _prompt(4) * 2  # repeats, so the prompt part of the penalty matters from the first token
    config = transformers.GenerationConfig(
        do_sample=False,
        repetition_penalty=1.3,
        max_new_tokens=STEPS,
        min_new_tokens=0,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    with torch.no_grad():
        result = reference.generate(torch.tensor([prompt]), generation_config=config)
    expected = result.sequences[0, len(prompt) :].tolist()
    # generate() ran exactly one processor: every step's scores are its raw logits through the repetition
    # penalty alone (no EOS masking, no temperature or top-k warpers).
    processor = transformers.RepetitionPenaltyLogitsProcessor(1.3)
    for step, (scores, logits) in enumerate(zip(result.scores, result.logits, strict=True)):
        seen = result.sequences[:, : len(prompt) + step]
        torch.testing.assert_close(scores, processor(seen, logits.clone()), atol=0, rtol=0)

    greedy = SamplingParams(max_tokens=STEPS, temperature=0)
    penalised = llm.generate(
        [prompt], SamplingParams(max_tokens=STEPS, temperature=0, repetition_penalty=1.3), use_tqdm=False
    )
    assert penalised[0].outputs[0].token_ids == expected
    assert llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids != expected  # the penalty bit


@torch.no_grad()
def _reference_penalised_greedy(model, prompt, steps, presence, frequency) -> list[int]:
    """OpenAI's formula applied by hand to transformers' logits: logit -= frequency * count + presence."""
    output: list[int] = []
    for _ in range(steps):
        logits = model(torch.tensor([prompt + output])).logits[0, -1].clone()
        for token in set(output):
            logits[token] -= frequency * output.count(token) + presence
        output.append(int(logits.argmax()))
    return output


def test_greedy_presence_and_frequency_penalties_equal_the_formula_on_transformers(tiny):
    llm, reference = tiny
    prompt = _prompt(5)
    params = SamplingParams(max_tokens=STEPS, temperature=0, presence_penalty=0.5, frequency_penalty=1.0)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == _reference_penalised_greedy(reference, prompt, STEPS, 0.5, 1.0)
    assert out.token_ids != reference_greedy(reference, prompt, STEPS)[0]  # the penalties changed the output


# -- stop strings on the real model ----------------------------------------------------------------
# The real model is slow on a shared CPU, so one batched generate() serves most tests below.

PROMPT = "The three most important things to know about the history of Paris are"
LONG = 24
NEVER = "@@never@@"


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    llm = LLM(smollm2_gguf, kv_cache_memory="256MiB", max_num_batched_tokens=64)
    [full] = llm.generate([PROMPT], _params(), use_tqdm=False)
    return llm, full.outputs[0]


def _params(**kwargs) -> SamplingParams:
    return SamplingParams(**{"max_tokens": LONG, "temperature": 0, "ignore_eos": True, **kwargs})


def _stop_spanning_tokens(llm: LLM, ids: list[int], at_token: int) -> str:
    """A stop string from the two characters before token `at_token` to the three after its start."""
    boundary = len(llm.tokenizer.decode(ids[:at_token]))
    return llm.tokenizer.decode(ids)[boundary - 2 : boundary + 3]


def _tokens_until(llm: LLM, ids: list[int], stop: str) -> int:
    return next(n for n in range(1, len(ids) + 1) if stop in llm.tokenizer.decode(ids[:n]))


@pytest.fixture(scope="module")
def stops(smol):
    llm, full = smol
    early, late = _stop_spanning_tokens(llm, full.token_ids, 8), _stop_spanning_tokens(llm, full.token_ids, 16)
    assert len(early) == len(late) == 5 and 0 < full.text.find(early) < full.text.find(late)
    params = {
        "cut": _params(stop=[late], logprobs=1),
        "kept": _params(stop=[late], include_stop_str_in_output=True),
        "earliest": _params(stop=[late, early]),
        "neighbour": _params(),
        "never": _params(stop=[NEVER]),
        "never, one token": _params(stop=[NEVER], max_tokens=1),
    }
    outputs = llm.generate([PROMPT] * len(params), list(params.values()), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    return early, late, {name: out.outputs[0] for name, out in zip(params, outputs, strict=True)}


def test_greedy_with_a_stop_string_is_the_full_output_cut_at_it(smol, stops):
    llm, full = smol
    _, stop, outputs = stops
    at = full.text.find(stop)
    n = _tokens_until(llm, full.token_ids, stop)
    for name, text in [("cut", full.text[:at]), ("kept", full.text[: at + len(stop)])]:
        completion = outputs[name]
        assert completion.finish_reason == "stop"
        assert completion.text == text
        assert completion.token_ids == full.token_ids[:n]  # generation stopped at the token completing the stop
    assert len(outputs["cut"].logprobs) == n


def test_the_earliest_of_several_stop_strings_wins_and_neighbours_run_on(smol, stops):
    _, full = smol
    early, _, outputs = stops
    assert outputs["earliest"].text == full.text[: full.text.find(early)]
    assert outputs["earliest"].finish_reason == "stop"
    assert outputs["neighbour"].token_ids == full.token_ids and outputs["neighbour"].finish_reason == "length"
    assert outputs["neighbour"].text == full.text


def test_streaming_with_a_stop_string_yields_the_cut_text(smol, stops):
    llm, full = smol
    early, _, _ = stops
    assert "".join(llm.stream(PROMPT, _params(stop=[early]))) == full.text[: full.text.find(early)]
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("name", ["never", "never, one token"])
def test_a_stop_string_never_reached_changes_nothing(smol, stops, name):
    llm, full = smol
    completion = stops[2][name]
    num = len(completion.token_ids)
    assert completion.token_ids == full.token_ids[:num] and completion.finish_reason == "length"
    assert num == (1 if name == "never, one token" else LONG)
    assert completion.text == llm.tokenizer.decode(full.token_ids[:num])
