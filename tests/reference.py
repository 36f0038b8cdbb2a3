"""Greedy decoding with a transformers model and no logits processors (generate() would, e.g., mask EOS
under min_new_tokens), returning the tokens and the logits at every position."""

from __future__ import annotations

import torch


@torch.no_grad()
def reference_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt])
    out = model(ids, use_cache=True)
    logits = [out.logits[0]]
    past = out.past_key_values
    generated: list[int] = []
    for step in range(new_tokens):
        token = int(logits[-1][-1].argmax())
        generated.append(token)
        if step == new_tokens - 1:
            break
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits[0])
    return generated, torch.cat(logits)
