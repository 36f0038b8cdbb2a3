"""The scheduler/runner boundary is made of values: a SchedulerOutput and a ModelRunnerOutput survive a
pickle round trip (as they must to reach a worker process), and a whole generation driven through
pickled copies gives exactly the tokens of EngineCore.step: greedy, seeded sampling, n > 1 forks,
structured output (the grammar bitmask), prompt logprobs and preemption."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from folio import LLM, SamplingParams, StructuredOutputParams
from folio.engine.request import Request
from folio.step import ModelRunnerOutput, SchedulerOutput

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [5, 6, 7, 8, 9, 10, 20, 21, 22]]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(max_tokens=12, temperature=0.9, seed=7, n=2, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=12, temperature=0, structured_output=StructuredOutputParams(regex="[a-c]{3,9}")),
    ]


def _run(llm: LLM, through_pickle: bool) -> tuple[list[list[int]], list[list[float]]]:
    engine = llm.engine
    requests = []
    for i, (prompt, params) in enumerate(zip(PROMPTS, _params(), strict=True)):
        group = [Request(f"{through_pickle}-{i}-{j}", prompt, dataclasses.replace(params, seed=params.sample_seed(j)),
                         eos_token_ids=frozenset(llm.model_config.eos_token_ids)) for j in range(params.n)]  # fmt: skip
        engine.add_request(group[0], group[1:])
        requests += group
    while engine.has_unfinished():
        if not through_pickle:
            engine.step()
            continue
        out = engine.scheduler.schedule()
        sent: SchedulerOutput = pickle.loads(pickle.dumps(out))
        assert dataclasses.replace(sent, grammar_bitmask=None) == dataclasses.replace(out, grammar_bitmask=None)
        if out.grammar_bitmask is not None:  # a tensor compares elementwise
            assert torch.equal(sent.grammar_bitmask.bits, out.grammar_bitmask.bits)
        result = engine.runner.execute(sent)
        received: ModelRunnerOutput = pickle.loads(pickle.dumps(result))
        engine.scheduler.update_from_output(out, received)
    scored = [[lp.logprob for lp in r.prompt_logprobs[1:]] for r in requests if r.sampling_params.prompt_logprobs]
    return [r.output_token_ids for r in requests], scored


@pytest.fixture(scope="module")
def tiny_llm(smollm2_gguf) -> LLM:
    # A small pool so that the requests preempt each other.
    return LLM(smollm2_gguf, num_kv_blocks=8, block_size=4, max_num_batched_tokens=8)


def test_a_generation_through_pickled_boundaries_matches_the_engine_step(tiny_llm):
    direct, direct_scores = _run(tiny_llm, through_pickle=False)
    preemptions = tiny_llm.engine.scheduler.num_preemptions
    copied, copied_scores = _run(tiny_llm, through_pickle=True)
    assert copied == direct and copied_scores == direct_scores
    assert all(len(tokens) > 0 for tokens in direct) and len(direct_scores[0]) == len(PROMPTS[0]) - 1
    assert preemptions > 0
    assert len(tiny_llm.engine.runner.requests) <= len(direct) + len(copied)  # finished ones are dropped
    tiny_llm.engine.step()  # an empty step hands the runner the last finished ids
    assert len(tiny_llm.engine.runner.requests) == 0


def test_the_boundary_values_are_frozen_and_hold_no_live_objects(tiny_llm):
    params = SamplingParams(max_tokens=2, temperature=0.5, seed=1, structured_output=StructuredOutputParams(regex="a+"))
    tiny_llm.engine.add_request(Request("frozen", [5, 6, 7], params))
    out = tiny_llm.engine.scheduler.schedule()
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.scheduled[0].start_position = 3  # type: ignore[misc]
    assert out.new_requests[0].prompt_token_ids == (5, 6, 7) and out.grammar_bitmask is not None
    result = tiny_llm.engine.runner.execute(out)
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.failed = {}  # type: ignore[misc]
    tiny_llm.engine.scheduler.update_from_output(out, result)
    tiny_llm.engine.abort_request("frozen")
    tiny_llm.engine.step()
    assert not tiny_llm.engine.has_unfinished() and len(tiny_llm.engine.runner.requests) == 0
