"""Drives EngineCore.step greedily and keeps the logits of every computed position, so tests can compare
them with a reference model. Every request scores its prompt (prompt_logprobs), so the runner computes
logits at every prompt position; the runner's logits observer hands them over."""

from __future__ import annotations

import torch

from folio.engine.engine_core import EngineCore
from folio.engine.request import Request
from folio.sampling_params import SamplingParams


def run_greedy_capturing_logits(
    engine: EngineCore, prompts: list[list[int]], max_tokens: int, lora_names: list[str | None] | None = None
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy-generate for every prompt at once (each with its LoRA adapter, if named); return output ids
    and logits [num_tokens-1, V] per request (logits at position p predict token p+1; the last generated
    token has none)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    names = lora_names or [None] * len(prompts)
    requests = [Request(str(i), list(p), params, lora_name=names[i]) for i, p in enumerate(prompts)]
    rows: dict[str, dict[int, torch.Tensor]] = {r.request_id: {} for r in requests}

    def observe(request_id: str, positions: list[int], logits: torch.Tensor) -> None:
        for position, row in zip(positions, logits, strict=True):
            rows[request_id][position] = row.to("cpu", copy=True)  # a GPU step's rows too

    engine.runner.logits_observer = observe
    try:
        for r in requests:
            engine.add_request(r)
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.runner.logits_observer = None
    stacked = [torch.stack([rows[r.request_id][p] for p in sorted(rows[r.request_id])]) for r in requests]
    return [r.output_token_ids for r in requests], stacked
