"""Tensor parallelism changes where the arithmetic runs, never the result: every architecture split
over 2 ranks (4 where heads allow) on loopback gives the single process's greedy tokens, and its
logprobs within 1e-4 in float32, under whole, chunked and preempting schedules."""

from __future__ import annotations

import json

import pytest

from folio import LLM, SamplingParams
from tests.parallel_compare import (
    GREEDY,
    TINY_PROMPTS,
    run_both,
    sample_both,
    starting_no_rank,
    structured_with_speculation,
)
from tests.tiny_models import NEW_ARCHITECTURE_KINDS, TINY_KINDS

TOLERANCE = 1e-4


@pytest.mark.parametrize("kind", TINY_KINDS + NEW_ARCHITECTURE_KINDS)
def test_two_ranks_match_one_process(tiny_folders, kind):
    result = run_both(tiny_folders[kind], TINY_PROMPTS, num_kv_blocks=64)
    assert result.same_tokens and result.max_logprob_diff < TOLERANCE, result


@pytest.mark.parametrize(("kind", "size"), [("gemma3", 2), ("llama", 4)])
def test_plain_greedy_takes_each_ranks_best_token(tiny_folders, kind, size):
    # Without logprobs the ranks exchange their vocabulary range's best token, not the logits: the
    # tokens equal those the reference samples from its whole logits (logprobs force that path).
    params = SamplingParams(max_tokens=12, temperature=0)
    reference, got = sample_both(tiny_folders[kind], TINY_PROMPTS, params, {"tensor_parallel_size": size},
                                 reference_params=GREEDY, num_kv_blocks=64)  # fmt: skip
    assert got == reference


def test_gloo_collectives_match_too(tiny_folders):
    # Ranks on one host exchange through shared memory by default; gloo is the path between hosts.
    split = {"tensor_parallel_size": 2, "cpu_collectives": "gloo"}
    result = run_both(tiny_folders["gemma3"], TINY_PROMPTS, split_kwargs=split, num_kv_blocks=64)
    assert result.same_tokens and result.max_logprob_diff < TOLERANCE, result


def test_four_ranks_replicate_kv_heads(tiny_folders):
    # 4 query heads, 2 KV heads: each KV head lives on the two ranks whose query heads read it.
    result = run_both(tiny_folders["llama"], TINY_PROMPTS, split_kwargs={"tensor_parallel_size": 4}, num_kv_blocks=64)
    assert result.same_tokens and result.max_logprob_diff < TOLERANCE, result


def test_chunked_prefill_and_preemption(tiny_folders):
    prompts = [[(7 * i + j) % 300 + 1 for j in range(40 + 5 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=3)
    # 8-token steps chunk every prompt; 20 blocks of 16 cannot hold six 70-token sequences at once.
    result = run_both(tiny_folders["gemma3"], prompts, params, num_kv_blocks=20, max_num_batched_tokens=8)
    assert result.same_tokens and result.max_logprob_diff < TOLERANCE, result


def test_seeded_sampling_and_parallel_samples(tiny_folders):
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=11, logprobs=2),
              SamplingParams(max_tokens=16, temperature=0.7, seed=5, n=2, logprobs=2)]  # fmt: skip
    reference, got = sample_both(tiny_folders["qwen2"], TINY_PROMPTS[:2], params, {"tensor_parallel_size": 2},
                                 num_kv_blocks=64)  # fmt: skip
    assert got == reference


def test_a_size_that_does_not_split_the_heads_names_the_valid_ones(tiny_folders):
    with starting_no_rank(), pytest.raises(ValueError, match=r"valid sizes for this model: 1, 2, 4"):
        LLM(tiny_folders["llama"], num_kv_blocks=64, tensor_parallel_size=3)


def test_gemma3_270m_dense_matches(gemma3_gguf):
    # The GGUF file dequantized to float32: only the order of the sums differs.
    prompts = ["The capital of France is", "def fibonacci(n):"]
    result = run_both(gemma3_gguf, prompts, kv_cache_memory="64MiB", quantization="none")
    assert result.same_tokens and result.max_logprob_diff < TOLERANCE, result


def test_gemma3_270m_kept_formats_match_greedy(gemma3_gguf):
    # Q4_K/Q6_K kept quantized, each rank holding its rows or columns of the blocks. The 4-bit kernel
    # rounds activations to 8 bits, so an ulp of difference in a reduced sum can move one rounding step:
    # greedy tokens stay equal and logprobs stay close, not within float32 rounding.
    prompts = ["The capital of France is", "def fibonacci(n):"]
    result = run_both(gemma3_gguf, prompts, kv_cache_memory="64MiB")
    assert result.same_tokens and result.max_logprob_diff < 2e-2, result


def test_smollm2_on_three_ranks_with_structured_output_and_speculation(smollm2_gguf):
    # 9 query heads and 3 KV heads split 3 ways; rank 0 drafts (prompt lookup) and the scheduler
    # compiles the grammar, so both work unchanged on a split model.
    reference, got, text = structured_with_speculation(smollm2_gguf, {"tensor_parallel_size": 3})
    assert got == reference
    json.loads(text)
