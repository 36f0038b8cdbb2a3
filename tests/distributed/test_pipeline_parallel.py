"""Pipeline parallelism, alone and with tensor parallelism, changes where the layers run, never the
result: every architecture split into 2 stages (of 1 or 2 ranks each) on loopback gives the single
process's greedy tokens and its logprobs within 1e-4 in float32, under whole, chunked and preempting
schedules, with steps cut into micro-batches that split prompts between them."""

from __future__ import annotations

import json

import psutil
import pytest

from folio import LLM, SamplingParams
from folio.structured.params import StructuredOutputParams
from tests.parallel_compare import TINY_PROMPTS, run_both
from tests.tiny_models import NEW_ARCHITECTURE_KINDS, TINY_KINDS, make_tiny_model

TOLERANCE = 1e-4
PP2 = {"pipeline_parallel_size": 2}
TP2_PP2 = {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp-tiny")
    return {kind: make_tiny_model(kind, root / kind) for kind in TINY_KINDS + NEW_ARCHITECTURE_KINDS}


@pytest.mark.parametrize("split", [PP2, TP2_PP2], ids=["pp2", "tp2xpp2"])
@pytest.mark.parametrize("kind", TINY_KINDS + NEW_ARCHITECTURE_KINDS)
def test_two_stages_match_one_process(tiny_folders, kind, split):
    result = run_both(tiny_folders[kind], TINY_PROMPTS, split_kwargs=split, num_kv_blocks=64)
    assert result.same_tokens and result.max_logprob_diff < TOLERANCE, result


@pytest.mark.parametrize("split", [{**PP2, "pipeline_micro_batches": 3, "pipeline_layers": (1, 2)},
                                   {**TP2_PP2, "cpu_collectives": "gloo"}],
                         ids=["pp2-layers-1-2-3-micro-batches", "tp2xpp2-gloo"])  # fmt: skip
def test_chunked_prefill_and_preemption(tiny_folders, split):
    prompts = [[(7 * i + j) % 300 + 1 for j in range(40 + 5 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=3, prompt_logprobs=2)
    # 8-token steps chunk every prompt; 20 blocks of 16 cannot hold six 70-token sequences at once.
    result = run_both(tiny_folders["llama"], prompts, params, split_kwargs=split, num_kv_blocks=20,
                      max_num_batched_tokens=8)  # fmt: skip
    assert result.same_tokens and result.max_logprob_diff < TOLERANCE, result


def test_seeded_sampling_and_parallel_samples(tiny_folders):
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=11, logprobs=2),
              SamplingParams(max_tokens=16, temperature=0.7, seed=5, n=2, logprobs=2)]  # fmt: skip
    reference = LLM(tiny_folders["qwen2"], num_kv_blocks=64).generate(TINY_PROMPTS[:2], params, use_tqdm=False)
    split = LLM(tiny_folders["qwen2"], num_kv_blocks=64, **PP2)
    try:
        got = split.generate(TINY_PROMPTS[:2], params, use_tqdm=False)
    finally:
        split.close()
    for a, b in zip(reference, got, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]


def test_more_stages_than_layers_is_refused_before_any_rank_starts(tiny_folders):
    before = len(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match=r"pipeline-parallel size of 4 needs at least one layer per stage; this model "
                                         r"has 3 layers"):  # fmt: skip
        LLM(tiny_folders["llama"], num_kv_blocks=64, pipeline_parallel_size=4)
    assert len(psutil.Process().children(recursive=True)) == before


def test_gemma3_270m_dense_matches(gemma3_gguf):
    # Its 262,144-row head outweighs most layers: the last stage holds it with one layer.
    prompts = ["The capital of France is", "def fibonacci(n):"]
    result = run_both(gemma3_gguf, prompts, split_kwargs=PP2, kv_cache_memory="64MiB", quantization="none")
    assert result.same_tokens and result.max_logprob_diff < TOLERANCE, result


def test_gemma3_270m_kept_formats_on_tp2_x_pp2(gemma3_gguf):
    # As with tensor parallelism alone (test_tensor_parallel.py): the 4-bit kernel's 8-bit activation
    # rounding can move by one step when a reduced sum differs in its last bit.
    prompts = ["The capital of France is", "def fibonacci(n):"]
    result = run_both(gemma3_gguf, prompts, split_kwargs=TP2_PP2, kv_cache_memory="64MiB")
    assert result.same_tokens and result.max_logprob_diff < 2e-2, result


def test_smollm2_pipeline_with_structured_output_and_speculation(smollm2_gguf):
    # Kept Q4_1 weights, a tied embedding (the last stage holds its rows as the head), and the last
    # stage's first rank drafting by prompt lookup.
    properties = {"city": {"enum": ["Paris", "London", "Rome"]}, "capital": {"type": "boolean"}}
    schema = {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}
    params = [
        SamplingParams(max_tokens=120, temperature=0, structured_output=StructuredOutputParams(json=schema)),
        SamplingParams(max_tokens=40, temperature=0, logprobs=2),
    ]
    prompts = ["Describe Paris as JSON:", "Repeat after me: one two three four five, one two three four five, one"]
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    reference = LLM(smollm2_gguf, kv_cache_memory="64MiB").generate(prompts, params, use_tqdm=False)
    split = LLM(smollm2_gguf, kv_cache_memory="64MiB", speculative_config=spec, **PP2)
    try:
        got = split.generate(prompts, params, use_tqdm=False)
    finally:
        split.close()
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in reference]
    json.loads(got[0].outputs[0].text)
