"""Drives an EngineCore step by step the way EngineCore.step does, but keeps the logits of every
computed position, so tests can compare them with a reference model."""

from __future__ import annotations

import torch

from folio.engine.engine_core import EngineCore
from folio.engine.request import Request
from folio.sampling_params import SamplingParams


def run_greedy_capturing_logits(
    engine: EngineCore, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy-generate for every prompt at once; return output ids and logits [num_tokens-1, V] per request
    (logits at position p predict token p+1; the last generated token has none)."""
    requests = [
        Request(str(i), list(p), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    for r in requests:
        engine.add_request(r)
    rows: dict[str, dict[int, torch.Tensor]] = {r.request_id: {} for r in requests}
    while engine.has_unfinished():
        out = engine.scheduler.schedule()
        inputs = engine.runner.prepare(out)
        hidden = engine.runner.forward(inputs)
        logits = engine.runner.compute_logits(hidden)
        offset = 0
        for item in out.scheduled:
            for i in range(item.num_tokens):
                rows[item.request_id][item.start_position + i] = logits[offset + i]
            offset += item.num_tokens
        sampled = {
            rid: int(logits[row].argmax()) for rid, row in zip(inputs.sampled_ids, inputs.logits_rows, strict=True)
        }
        engine.scheduler.update_from_output(out, sampled)
    stacked = [torch.stack([rows[r.request_id][p] for p in sorted(rows[r.request_id])]) for r in requests]
    return [r.output_token_ids for r in requests], stacked
