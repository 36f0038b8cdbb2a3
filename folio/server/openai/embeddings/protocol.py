"""The request body of POST /v1/embeddings (OpenAI's shape), validated by pydantic: unknown fields,
empty inputs and out-of-range values get a 400."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictInt, model_validator

from folio.loaders.tokenizer import Tokenizer
from folio.server.limits import RequestLimits
from folio.server.request_body import RequestBody


class EmbeddingRequest(RequestBody):
    model: str
    # Strict integers: JSON's true/false are no token ids (nor a dimension count).
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] | None = "float"  # base64: little-endian float32 bytes; null: float
    dimensions: StrictInt | None = Field(None, ge=1)  # keep the first k values, then normalise again
    user: str | None = None

    @property
    def inputs(self) -> list[str] | list[list[int]]:
        """One item per input: a text, or a list of token ids."""
        given = self.input
        one = isinstance(given, str) or (given and isinstance(given[0], int))
        return [given] if one else given  # type: ignore[return-value,list-item]

    @model_validator(mode="after")
    def _inputs_not_empty(self) -> EmbeddingRequest:
        inputs = self.inputs
        if not inputs:
            raise ValueError("input must not be empty")
        if any(len(item) == 0 for item in inputs):
            raise ValueError("input must not hold an empty string or an empty list of token ids")
        return self

    def token_inputs(self, tokenizer: Tokenizer, limits: RequestLimits) -> list[list[int]]:
        """Each input's token ids: text is tokenized, token ids are taken as given. Their count is checked
        before any is tokenized (--max-request-inputs), their tokens together after (--max-request-tokens)."""
        limits.check_inputs(len(self.inputs), "input")
        inputs = [tokenizer.encode(item) if isinstance(item, str) else list(item) for item in self.inputs]
        limits.check_prompt_tokens(sum(len(ids) for ids in inputs), "input")
        return inputs
