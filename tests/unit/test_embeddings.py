"""The pure parts of embeddings: pooling across chunked-prefill steps, the API's vector encodings and
dimension cuts, the request body's checks, and the parameters' own validation."""

from __future__ import annotations

import argparse
import base64

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from folio.config import SchedulerConfig
from folio.engine_args import EngineArgs
from folio.sampling_params import PoolingParams, SamplingParams
from folio.server.errors import APIError
from folio.server.limits import RequestLimits
from folio.server.openai.embeddings import EmbeddingRequest, encode_vector, fit_dimensions
from folio.step import NewRequestData, ScheduledChunk, SchedulerOutput
from folio.worker.batch_inputs import prepare_batch
from folio.worker.pooling import PoolSpan, pool_embeddings
from folio.worker.request_states import RequestStates

HIDDEN = 8


def _states(prompt_lengths: dict[str, int], pooling: PoolingParams) -> RequestStates:
    states = RequestStates()
    params = SamplingParams(pooling=pooling)
    new = tuple(NewRequestData(rid, tuple(range(n)), (), params) for rid, n in prompt_lengths.items())
    states.update(SchedulerOutput(new_requests=new))
    return states


def _span(first_row: int, end_row: int, start: int, ends: bool, method: str, normalize: bool = False) -> PoolSpan:
    return PoolSpan(first_row, end_row, start, ends, PoolingParams(method, normalize))


def test_mean_pooling_sums_across_chunks_and_restarts_at_position_zero():
    prompt = torch.randn(10, HIDDEN)
    states = _states({"a": 10}, PoolingParams("mean", False))
    other = torch.randn(3, HIDDEN)  # another request's rows share each step's batch
    step1 = torch.cat([other, prompt[:4]])
    assert pool_embeddings(step1, {"a": _span(3, 7, 0, False, "mean")}, states) == ({}, {})
    # Preempted: the prompt is computed again from position 0, and the first sum must not count.
    pool_embeddings(prompt[:6], {"a": _span(0, 6, 0, False, "mean")}, states)
    step3 = torch.cat([prompt[6:], other])
    done, failed = pool_embeddings(step3, {"a": _span(0, 4, 6, True, "mean")}, states)
    assert failed == {} and set(done) == {"a"}
    torch.testing.assert_close(done["a"], prompt.mean(dim=0))
    assert states["a"].pool_sum is None  # nothing kept once pooled


def test_last_pooling_reads_the_last_prompt_row_only_when_the_prompt_ends():
    hidden = torch.randn(6, HIDDEN)
    states = _states({"a": 9, "b": 2}, PoolingParams("last", True))
    spans = {"a": _span(0, 4, 0, False, "last", True), "b": _span(4, 6, 0, True, "last", True)}
    assert spans["a"].rows == range(0) and spans["b"].rows == range(5, 6)
    assert _span(0, 4, 0, False, "mean").rows == range(0, 4)
    done, failed = pool_embeddings(hidden, spans, states)
    assert failed == {} and set(done) == {"b"}
    torch.testing.assert_close(done["b"], F.normalize(hidden[5], dim=0))
    assert float(done["b"].norm()) == pytest.approx(1.0)


def test_non_finite_hidden_states_fail_that_request_only():
    hidden = torch.randn(4, HIDDEN)
    hidden[1, 3] = float("nan")
    states = _states({"bad": 2, "good": 2}, PoolingParams("mean", True))
    spans = {"bad": _span(0, 2, 0, True, "mean"), "good": _span(2, 4, 0, True, "mean")}
    done, failed = pool_embeddings(hidden, spans, states)
    assert set(done) == {"good"} and set(failed) == {"bad"}


def test_prepared_batch_pools_embedding_rows_and_samples_none_of_them():
    states = RequestStates()
    out = SchedulerOutput(
        new_requests=(NewRequestData("e", (5, 6, 7), (), SamplingParams(pooling=PoolingParams("mean"))),
                      NewRequestData("g", (1, 2), (), SamplingParams(temperature=0))),
        scheduled=(ScheduledChunk("g", [1, 2], 0, 0, ((0,),), True),
                   ScheduledChunk("e", [5, 6, 7], 0, 0, ((1,),), True)),
    )  # fmt: skip
    states.update(out)
    inputs = prepare_batch(out, states, vocab_size=16, block_size=4, device=torch.device("cpu"))
    assert inputs.sampled_ids == ["g"] and inputs.logits_rows == [1]
    assert inputs.pooled == {"e": PoolSpan(2, 5, 0, True, PoolingParams("mean"))}


def test_base64_is_little_endian_float32():
    assert encode_vector(torch.tensor([1.0]), "base64") == "AACAPw=="  # 0x3f800000, little-endian
    vector = torch.randn(HIDDEN)
    decoded = np.frombuffer(base64.b64decode(encode_vector(vector, "base64")), dtype="<f4")
    assert decoded.tolist() == vector.tolist()  # exact: both are the same float32 values
    assert encode_vector(vector, "float") == vector.tolist()


def test_dimensions_keep_the_first_values_normalised_again():
    vector = F.normalize(torch.randn(HIDDEN), dim=0)
    assert fit_dimensions(vector, None) is vector
    short = fit_dimensions(vector, 3)
    torch.testing.assert_close(short, vector[:3] / vector[:3].norm())
    torch.testing.assert_close(fit_dimensions(vector, HIDDEN), vector)


def test_pooling_parameters_are_checked():
    with pytest.raises(ValueError, match="pooling must be one of last, mean"):
        PoolingParams("max")
    with pytest.raises(ValueError, match="pooling must be one of last, mean"):
        SchedulerConfig(pooling="cls")
    for bad in ({"n": 2}, {"use_beam_search": True}, {"prompt_logprobs": 1}):
        with pytest.raises(ValueError, match="an embedding request samples nothing"):
            SamplingParams(pooling=PoolingParams(), **bad)
    # A cached block has no hidden states: mean pooling (or a method not yet resolved) computes every position.
    assert SamplingParams(pooling=PoolingParams()).reads_every_prompt_position
    assert SamplingParams(pooling=PoolingParams("mean")).reads_every_prompt_position
    assert not SamplingParams(pooling=PoolingParams("last")).reads_every_prompt_position
    assert not SamplingParams().reads_every_prompt_position


def test_pooling_is_an_engine_flag():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["m", "--pooling", "mean"]))
    assert args.pooling == "mean" and args.scheduler_config(512).pooling == "mean"
    flags = args.to_cli_flags()
    assert flags[flags.index("--pooling") + 1] == "mean"
    assert EngineArgs("m").scheduler_config(512).pooling == "last"


@pytest.mark.parametrize(
    "body",
    [
        {"input": ""},
        {"input": []},
        {"input": ["a", ""]},
        {"input": [[]]},
        {"input": [[1], []]},
        {"input": "a", "dimensions": 0},
        {"input": "a", "encoding_format": "bf16"},
        {"input": "a", "suffix": "x"},  # unknown fields are refused
        {"input": [1, "a"]},
        {"input": 5},
        {"input": [True, False]},
        {"input": "a", "dimensions": True},
    ],
)
def test_bad_bodies_are_refused(body):
    with pytest.raises(ValidationError):
        EmbeddingRequest(model="m", **body)


class _Words:
    def encode(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]


def test_every_input_form_becomes_token_ids():
    def ids(given):
        return EmbeddingRequest(model="m", input=given).token_inputs(_Words(), RequestLimits())

    assert ids("ab c") == [[2, 1]]
    assert ids(["ab", "abc d"]) == [[2], [3, 1]]
    assert ids([7, 8]) == [[7, 8]]
    assert ids([7] * 5000) == [[7] * 5000]  # one input of many tokens, not many inputs
    assert ids([[7], [8, 9]]) == [[7], [8, 9]]


@pytest.mark.parametrize(
    ("given", "flag"),
    [(["a"] * 2049, "--max-request-inputs"), ([[1]] * 2049, "--max-request-inputs"),
     (["a b c d e f"] * 10, "--max-request-tokens"), ([[1] * 30] * 2, "--max-request-tokens")],
)  # fmt: skip
def test_too_many_inputs_or_tokens_are_400(given, flag):
    limits = RequestLimits(max_inputs=2048, max_prompt_tokens=50)
    with pytest.raises(APIError, match=flag) as caught:
        EmbeddingRequest(model="m", input=given).token_inputs(_Words(), limits)
    assert caught.value.status == 400 and caught.value.param == "input"
