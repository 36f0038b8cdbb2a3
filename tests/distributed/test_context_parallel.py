"""Context parallelism changes where each token's row runs and where its keys are kept, never the
result: every architecture with its sequences split by position over 2 ranks (4 for one) on loopback
gives the single process's greedy tokens and logprobs within 1e-4 in float32, under whole, chunked,
preempting and prefix-cached schedules, with 8-bit caches, speculation and structured output."""

from __future__ import annotations

import json

import pytest

from folio import LLM, SamplingParams
from tests.parallel_compare import TINY_PROMPTS, run_both, sample_both, starting_no_rank, structured_with_speculation
from tests.tiny_models import NEW_ARCHITECTURE_KINDS, TINY_KINDS

TOLERANCE = 1e-4
CP2 = {"context_parallel_size": 2}


@pytest.mark.parametrize("kind", TINY_KINDS + NEW_ARCHITECTURE_KINDS)
def test_two_ranks_match_one_process(tiny_folders, kind):
    result = run_both(tiny_folders[kind], TINY_PROMPTS, split_kwargs=CP2, num_kv_blocks=64)
    assert result.same_tokens and result.max_logprob_diff < TOLERANCE, result


@pytest.mark.parametrize("split", [{"context_parallel_size": 4}, {**CP2, "cpu_collectives": "gloo"}],
                         ids=["cp4", "cp2-gloo"])  # fmt: skip
def test_chunked_prefill_preemption_and_prefix_hits(tiny_folders, split):
    # 8-token steps chunk every prompt; 20 blocks of 16 cannot hold six 70-token sequences at once; the
    # prompts share a 32-token head, so later ones start from cached blocks whose keys are spread too.
    head = [(3 * j) % 300 + 1 for j in range(32)]
    prompts = [head + [(7 * i + j) % 300 + 1 for j in range(8 + 5 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=3, prompt_logprobs=2)
    result = run_both(tiny_folders["mistral-window"], prompts, params, split_kwargs=split, num_kv_blocks=20,
                      max_num_batched_tokens=8)  # fmt: skip
    assert result.same_tokens and result.max_logprob_diff < TOLERANCE, result


def test_a_long_prompt_in_one_chunk_and_8_bit_cache(tiny_folders):
    # One 300-token prompt prefilled in a single step: each rank computes 150 of its rows. The cache
    # holds int8 codes with per-token scales on both sides.
    prompt = [[(11 * j) % 300 + 1 for j in range(300)]]
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=3)
    result = run_both(tiny_folders["gemma3"], prompt, params, split_kwargs=CP2, num_kv_blocks=64,
                      max_num_batched_tokens=512, kv_cache_dtype="int8")  # fmt: skip
    assert result.same_tokens and result.max_logprob_diff < TOLERANCE, result


def test_seeded_sampling_parallel_samples_and_plain_greedy(tiny_folders):
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=11, logprobs=2),
              SamplingParams(max_tokens=16, temperature=0.7, seed=5, n=2, logprobs=2),
              SamplingParams(max_tokens=16, temperature=0)]  # fmt: skip
    reference, got = sample_both(tiny_folders["qwen2"], TINY_PROMPTS, params, CP2, num_kv_blocks=64)
    assert got == reference


def test_a_block_size_the_ranks_do_not_divide_is_refused_before_any_rank_starts(tiny_folders):
    with starting_no_rank():
        with pytest.raises(ValueError, match=r"context-parallel size of 3 needs a block size that divides by it"):
            LLM(tiny_folders["llama"], num_kv_blocks=64, context_parallel_size=3)
        with pytest.raises(ValueError, match=r"does not combine with tensor or pipeline parallelism"):
            LLM(tiny_folders["llama"], num_kv_blocks=64, context_parallel_size=2, tensor_parallel_size=2)


def test_gemma3_270m_dense_matches(gemma3_gguf):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    result = run_both(gemma3_gguf, prompts, split_kwargs=CP2, kv_cache_memory="64MiB", quantization="none")
    assert result.same_tokens and result.max_logprob_diff < TOLERANCE, result


def test_smollm2_with_structured_output_and_speculation(smollm2_gguf):
    # Kept Q4_1 weights (identical on both ranks: only the attention's sums are ordered differently),
    # rank 0 drafting by prompt lookup, drafts verified as rows spread over both ranks.
    reference, got, text = structured_with_speculation(smollm2_gguf, CP2)
    assert got == reference
    json.loads(text)
