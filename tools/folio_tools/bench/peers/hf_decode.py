"""`folio bench decode --peer hf`: Hugging Face transformers' decode and prefill rates on the same
model, device and dtype as folio's, measured the way `decode.py` measures folio's.

- batch-1 decode: `generate` of `gen_tokens` greedy tokens after the bench prompt, less a `generate`
  of one token (the prompt's prefill and the call's set-up), over `gen_tokens - 1`: prefill excluded;
- batched: `batch` left-padded prompts decoding `gen_tokens` each in one `generate`, output tok/s;
- prefill: one forward over a prompt of random ids that keeps the last position's logits only.
Each is the best of `repeats`. Where llama.cpp cannot run (a GPU with no llama.cpp build here), this is
the peer measured side by side.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from folio_tools.bench.peers.hf import load_hf_model


def _seconds(work: Callable[[], Any], device: torch.device) -> float:
    start = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, tokens: int) -> Callable[[], Any]:
    return lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                                  do_sample=False, pad_token_id=0)  # fmt: skip


def hf_decode_rates(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    prompt_ids: list[int],
    gen_tokens: int,
    batch: int,
    prefill_prompts: dict[int, list[int]],
    repeats: int,
) -> tuple[float, float, dict[str, float]]:
    """(batch-1 decode tok/s, batch-`batch` output tok/s, prompt tok/s per prefill length)."""
    model, _ = load_hf_model(path, dtype)
    model = model.to(device)
    with torch.inference_mode():
        one = torch.tensor([prompt_ids], device=device)
        ones = torch.ones_like(one)
        _seconds(_generate(model, one, ones, 8), device)  # warm-up: kernels picked, allocator grown
        batch1 = 0.0
        for _ in range(repeats):
            whole = _seconds(_generate(model, one, ones, gen_tokens), device)
            start_up = _seconds(_generate(model, one, ones, 1), device)
            batch1 = max(batch1, (gen_tokens - 1) / max(whole - start_up, 1e-9))
        many = one.repeat(batch, 1)
        _seconds(_generate(model, many, torch.ones_like(many), 8), device)
        batched = max(batch * gen_tokens / _seconds(_generate(model, many, torch.ones_like(many), gen_tokens), device)
                      for _ in range(repeats))  # fmt: skip
        prefill: dict[str, float] = {}
        for length, ids in prefill_prompts.items():
            prompt = torch.tensor([ids], device=device)
            forward = functools.partial(model, input_ids=prompt, use_cache=False, logits_to_keep=1)
            _seconds(forward, device)
            prefill[str(length)] = max(length / _seconds(forward, device) for _ in range(repeats))
    model.to("cpu")  # give the device's memory back
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return batch1, batched, prefill
