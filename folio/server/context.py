"""What every route handler needs: the engine, the tokenizer, the served name, and admission limits."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from folio.engine.async_engine import AsyncEngine, RequestUpdate
from folio.loaders.tokenizer import Tokenizer
from folio.sampling_params import SamplingParams
from folio.server.admission import Admission
from folio.server.errors import APIError


@dataclass
class ServerContext:
    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    vocab_size: int
    admission: Admission

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")  # fmt: skip

    def check_prompt(self, ids: list[int]) -> None:
        """Refuse prompts the engine could not run, before anything is streamed."""
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        if len(ids) >= self.max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has {len(ids)} "
                "tokens, leaving no room to generate",
                param="prompt",
                code="context_length_exceeded",
            )

    def default_max_tokens(self, prompt_len: int) -> int:
        return self.max_model_len - prompt_len

    def generate(
        self, ids: list[int], params: list[SamplingParams], cache_salt: str | None, priority: int
    ) -> list[AsyncIterator[RequestUpdate]]:
        """One stream per sample; several samples share the prompt's KV blocks."""
        if len(params) == 1:
            return [self.engine.generate(ids, params[0], cache_salt, priority)]
        return self.engine.generate_samples(ids, params, cache_salt, priority)
