"""lm-eval's `local-completions` model against `folio serve` on a task kept in the repository
(tests/data/eval_task: no hub download), loglikelihood and generate_until requests, and the same task
scored offline by folio's LLM: every sample's score and answer must agree.

lm-eval tokenizes through the server (`tokenizer_backend=remote`: /tokenizer_info, /tokenize,
/detokenize), sends token ids with `echo` and `logprobs` for loglikelihoods, and text with stop strings
for generations."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lm_eval
import pytest
from lm_eval.tasks import TaskManager

from folio import LLM, SamplingParams
from tests.api.server_runner import MODEL

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "data" / "eval_task"


@pytest.fixture(scope="module")
def harness_results(base_url: str, monkeypatch_module) -> dict:
    monkeypatch_module.chdir(REPO)  # the task's data path is relative to the repository
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    model_args = {"model": MODEL, "base_url": f"{base_url}/v1/completions", "tokenizer_backend": "remote",
                  "num_concurrent": 4, "max_retries": 1}  # fmt: skip
    return lm_eval.simple_evaluate(model="local-completions", model_args=model_args, log_samples=True,
                                   tasks=["folio_capitals_mc", "folio_capitals_gen"],
                                   task_manager=TaskManager(include_path=str(TASKS)))  # fmt: skip


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _documents() -> list[dict]:
    return [json.loads(line) for line in (TASKS / "capitals.jsonl").read_text().splitlines()]


def _offline_loglikelihood(llm: LLM, context: str, continuation: str) -> tuple[float, bool]:
    """What lm-eval asks for, computed by folio offline: the continuation's summed logprob given the
    context (tokenized as lm-eval does: the whole, less the context's own tokens), and whether each of
    its tokens was the most likely one."""
    whole = llm.tokenizer.encode(context + continuation, add_special_tokens=False)
    start = len(llm.tokenizer.encode(context, add_special_tokens=False))
    [output] = llm.generate([whole], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False)
    scored = output.prompt_logprobs[start:]
    total = sum(entry.logprob for entry in scored)
    greedy = all(entry.logprob >= max(lp for _, lp in entry.top) - 1e-6 for entry in scored)
    return total, greedy


def test_loglikelihoods_equal_folios_offline_scores(harness_results: dict, offline_llm: LLM) -> None:
    samples = harness_results["samples"]["folio_capitals_mc"]
    correct = 0
    for sample, document in zip(sorted(samples, key=lambda s: s["doc_id"]), _documents(), strict=True):
        scores = []
        for (context, continuation), [(served, served_greedy)] in zip(sample["arguments"], sample["resps"],
                                                                      strict=True):  # fmt: skip
            offline, offline_greedy = _offline_loglikelihood(offline_llm, context, continuation)
            # Served requests share steps with others: the packed-weight kernels see other batch shapes.
            assert served == pytest.approx(offline, rel=1e-4, abs=1e-4)
            assert served_greedy == offline_greedy
            scores.append(offline)
        correct += max(range(len(scores)), key=scores.__getitem__) == document["answer"]
    accuracy = harness_results["results"]["folio_capitals_mc"]["acc,none"]
    assert math.isclose(accuracy, correct / len(samples)) and accuracy >= 0.5  # the model knows most capitals


def test_generations_equal_folios_offline_answers(harness_results: dict, offline_llm: LLM) -> None:
    samples = sorted(harness_results["samples"]["folio_capitals_gen"], key=lambda s: s["doc_id"])
    prompts = [sample["arguments"][0][0] for sample in samples]
    params = SamplingParams(max_tokens=8, temperature=0, stop=["\n", "."])
    offline = [o.outputs[0].text for o in offline_llm.generate(prompts, params, use_tqdm=False)]
    assert [sample["resps"][0][0] for sample in samples] == offline
    matches = [
        o.strip().lower() == d["choices"][d["answer"]].lower() for o, d in zip(offline, _documents(), strict=True)
    ]
    assert harness_results["results"]["folio_capitals_gen"]["exact_match,none"] == pytest.approx(sum(matches) / 8)
