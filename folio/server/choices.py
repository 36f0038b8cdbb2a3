"""The choices of one API call (n choices x prompts), accumulated from their engine updates."""

from __future__ import annotations

from dataclasses import dataclass, field

from folio.outputs import TokenLogprob
from folio.server.engine_client.protocol import GenerationStream
from folio.server.engine_client.updates import RequestUpdate


@dataclass
class ChoiceResult:
    """A finished choice, accumulated from its updates (the non-streaming responses use this)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # if asked for, from the request's first update
    stop_reason: str | None = None  # the stop string that ended it

    def add(self, update: RequestUpdate) -> None:
        if update.prompt_logprobs is not None:
            self.prompt_logprobs = update.prompt_logprobs
        self.text += update.text
        self.token_ids.extend(update.new_token_ids)
        self.logprobs.extend(update.new_logprobs)
        self.num_prompt_tokens = update.num_prompt_tokens
        if update.finished:
            self.finish_reason = update.finish_reason
            self.stop_reason = update.stop_reason


async def collect(generation: GenerationStream, num_choices: int) -> list[ChoiceResult]:
    """Every choice's whole result; raises if a choice fails or the engine dies."""
    results = [ChoiceResult() for _ in range(num_choices)]
    async for index, update in generation:
        results[index].add(update)
    return results
