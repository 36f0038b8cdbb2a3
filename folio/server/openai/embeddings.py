"""POST /v1/embeddings: inputs (text, texts, token ids) -> one vector each, the model's final hidden
states pooled as the engine's `--pooling` says and L2-normalised.

Each input is an engine request that computes its prompt and samples nothing; it runs in the same steps
as generation requests (continuous batching, chunked prefill) and takes an admission slot like one.
"""

from __future__ import annotations

import base64
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, StrictInt, model_validator
from starlette.concurrency import run_in_threadpool

from folio.loaders.tokenizer import Tokenizer
from folio.sampling_params import PoolingParams, SamplingParams
from folio.server.context import ServerContext
from folio.server.engine_client.protocol import GenerationStream
from folio.server.engine_client.updates import RequestFailedError
from folio.server.errors import APIError, engine_errors
from folio.server.limits import RequestLimits
from folio.server.request_body import RequestBody

# The engine's pooling (None: its --pooling option), normalised as OpenAI's embeddings are.
EMBEDDING_PARAMS = SamplingParams(max_tokens=1, pooling=PoolingParams())


class EmbeddingRequest(RequestBody):
    """OpenAI's body: unknown fields, empty inputs and out-of-range values get a 400."""

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


async def create_embedding(ctx: ServerContext, body: EmbeddingRequest) -> dict:
    inputs = await run_in_threadpool(body.token_inputs, ctx.tokenizer, ctx.limits)  # off the event loop
    vectors = await embed_inputs(ctx, inputs, body.dimensions)
    data = [
        {"object": "embedding", "index": index, "embedding": encode_vector(vector, body.encoding_format or "float")}
        for index, vector in enumerate(vectors)
    ]
    tokens = sum(len(ids) for ids in inputs)
    return {"object": "list", "data": data, "model": ctx.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip


async def embed_inputs(ctx: ServerContext, inputs: list[list[int]], dimensions: int | None) -> list[torch.Tensor]:
    """One vector per input (cut to `dimensions`), each input an engine request. Everything is checked
    before the call takes admission slots or engine requests. Ollama's /api/embed uses this too."""
    for ids in inputs:
        ctx.check_prompt(ids, param="input", generates=False)
    if dimensions is not None and dimensions > ctx.hidden_size:
        raise APIError(400, f"dimensions must be at most the model's embedding size, {ctx.hidden_size}; got "
                       f"{dimensions}", param="dimensions")  # fmt: skip
    with ctx.open_call(len(inputs), "input") as call, engine_errors():
        for ids in inputs:
            call.generation.add(ids, [EMBEDDING_PARAMS])
        vectors = await _collect(call.generation, len(inputs))
    return [fit_dimensions(vector, dimensions) for vector in vectors]


async def _collect(generation: GenerationStream, count: int) -> list[torch.Tensor]:
    """Every input's vector; raises if one fails or the engine dies."""
    vectors: list[torch.Tensor | None] = [None] * count
    async for index, update in generation:
        if update.finished:
            vectors[index] = update.embedding
    if any(vector is None for vector in vectors):  # every pooling request ends with its vector or an error
        raise RequestFailedError("the engine returned no embedding")
    return vectors  # type: ignore[return-value]


# An embedding as the API returns it: cut to the dimensions asked for, then as JSON floats or base64.
def fit_dimensions(vector: torch.Tensor, dimensions: int | None) -> torch.Tensor:
    """The first `dimensions` values normalised again to unit length (as OpenAI shortens its Matryoshka-
    trained embeddings); the vector itself when `dimensions` is None."""
    if dimensions is None:
        return vector
    return F.normalize(vector[:dimensions].float(), dim=0)


def encode_vector(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """The vector as JSON floats ("float") or its little-endian float32 bytes in base64 ("base64"), as OpenAI
    sends them."""
    values = vector.detach().float().cpu().numpy()
    if encoding_format == "base64":
        return base64.b64encode(values.astype("<f4").tobytes()).decode("ascii")
    return values.tolist()
