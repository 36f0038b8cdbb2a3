"""Prefill speed: prompt tokens per second for prompts of given lengths, folio's and llama-bench's pp.

folio's is timed from a request's arrival to its first token, for a prompt of random token ids (a new
draw each repeat, so the prefix cache never holds any of it) and one output token: what the prompt's
forward passes cost, in the engine's own chunks (`max_num_batched_tokens`), plus one LM head row and
one sample, as llama-bench's pp computes the prompt's logits for its last token only.
"""

from __future__ import annotations

import torch

from folio import LLM, SamplingParams

DEFAULT_LENGTHS = (128, 512, 2048)


def random_prompt(llm: LLM, num_tokens: int, seed: int) -> list[int]:
    """Token ids drawn from the vocabulary's middle (away from special tokens at either end)."""
    vocab = llm.loaded.config.vocab_size
    low, high = min(1000, vocab // 4), vocab - min(1000, vocab // 4)
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (num_tokens,), generator=generator).tolist()


def measure_prefill(llm: LLM, num_tokens: int, repeats: int, seed: int = 0) -> float:
    """Best prompt tok/s over `repeats` prompts of `num_tokens` random tokens (an engine measured again
    needs another `seed`: its cache holds the prompts of this one)."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    best = 0.0
    for repeat in range(repeats):
        prompt = random_prompt(llm, num_tokens, seed=(seed * 100 + repeat) * 100_003 + num_tokens)
        [out] = llm.generate([prompt], params, use_tqdm=False)
        if out.metrics.num_cached_tokens:
            raise RuntimeError("a random prompt hit the prefix cache: the measurement would not be a prefill")
        best = max(best, num_tokens / out.metrics.time_to_first_token)
    return best
