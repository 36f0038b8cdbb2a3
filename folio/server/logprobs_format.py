"""Logprobs in the two shapes OpenAI uses: the legacy completions object and chat's content list.

Token strings are each token decoded on its own (special tokens included), as vLLM and OpenAI show
them; a token holding part of a multi-byte character shows as the replacement character.
"""

from __future__ import annotations

from functools import lru_cache

from folio.loaders.tokenizer import Tokenizer
from folio.outputs import TokenLogprob


class TokenText:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._decode = lru_cache(maxsize=65536)(lambda t: tokenizer.decode([t], skip_special_tokens=False))

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)


def completion_logprobs(token_text: TokenText, logprobs: list[TokenLogprob], text_offset: int) -> tuple[dict, int]:
    """The completions `logprobs` object for these tokens; also returns the offset after them."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in logprobs:
        text = token_text(entry.token_id)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        top_logprobs.append({token_text(t): lp for t, lp in entry.top})
        offsets.append(text_offset)
        text_offset += len(text)
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
    return body, text_offset


def chat_logprobs(token_text: TokenText, logprobs: list[TokenLogprob]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in logprobs]
    }
