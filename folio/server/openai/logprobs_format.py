"""Logprobs in the two shapes OpenAI uses: the legacy completions object and chat's content list.

Token strings are each token decoded on its own (special tokens included), as vLLM and OpenAI show
them; a token holding part of a multi-byte character shows as the replacement character.
"""

from __future__ import annotations

from functools import lru_cache

from folio.loaders.tokenizer import Tokenizer
from folio.outputs import TokenLogprob

TokenPosition = tuple[int, TokenLogprob | None]  # a prompt token and its logprob (None: the first token)


class TokenText:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._decode = lru_cache(maxsize=65536)(lambda t: tokenizer.decode([t], skip_special_tokens=False))

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)


def completion_logprobs(
    token_text: TokenText, logprobs: list[TokenLogprob], text_offset: int, prompt: list[TokenPosition] | None = None
) -> tuple[dict, int]:
    """The completions `logprobs` object for these tokens, after the echoed prompt's tokens if given
    (the first of which has null logprobs, as in OpenAI's legacy completions); also returns the offset
    after them."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    entries: list[TokenPosition] = [*(prompt or []), *((e.token_id, e) for e in logprobs)]
    for token_id, entry in entries:
        text = token_text(token_id)
        tokens.append(text)
        token_logprobs.append(None if entry is None else entry.logprob)
        top_logprobs.append(None if entry is None else {token_text(t): lp for t, lp in entry.top})
        offsets.append(text_offset)
        text_offset += len(text)
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
    return body, text_offset


def prompt_positions(prompt_token_ids: list[int], scores: list[TokenLogprob | None]) -> list[TokenPosition]:
    """Each prompt token with its logprob (None for the first, which nothing predicts, and for any the
    engine did not score)."""
    return [(token_id, scores[i] if i < len(scores) else None) for i, token_id in enumerate(prompt_token_ids)]


def vllm_prompt_logprobs(token_text: TokenText, positions: list[TokenPosition]) -> list[dict | None]:
    """vLLM's `prompt_logprobs` field: per prompt token, None for the first, else {token id: {logprob,
    decoded_token}} for the prompt's token and its top alternatives."""
    result: list[dict | None] = []
    for token_id, entry in positions:
        if entry is None:
            result.append(None)
            continue
        found = {token_id: entry.logprob, **dict(entry.top)}
        result.append({str(t): {"logprob": lp, "decoded_token": token_text(t)} for t, lp in found.items()})
    return result


def chat_logprobs(token_text: TokenText, logprobs: list[TokenLogprob]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in logprobs]
    }
