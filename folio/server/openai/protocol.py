"""Request bodies of the OpenAI-compatible API, validated by pydantic (out-of-range values -> 400).

Unknown fields are refused. OpenAI parameters folio does not implement are declared so that a request
setting one gets a 400 naming it (`reject_unsupported`), never a silent no-op; sending them as null
is the same as leaving them out. The fields that ask for structured output (`StructuredFields`) are
OpenAI's `response_format` and vLLM's extensions (`structured_outputs`, and the older `guided_json` /
`guided_regex` / `guided_choice` / `guided_grammar`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from folio.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS, SamplingParams
from folio.server.errors import APIError
from folio.server.limits import RequestLimits
from folio.server.openai.chat.messages import ChatMessage
from folio.server.request_body import RequestBody, StrictModel
from folio.structured.params import StructuredOutputParams

MAX_N = 16  # choices per request
_TOKEN_ID = re.compile(r"0|[1-9][0-9]*")  # a logit_bias key: a token id in plain ASCII decimal


class StreamOptions(StrictModel):
    include_usage: bool = False


class JSONSchemaFormat(StrictModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # folio always enforces the schema


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only then")
        return self


class StructuredOutputsField(StrictModel):
    """vLLM's `structured_outputs` object: exactly one of its constraints."""

    model_config = ConfigDict(populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class StructuredFields(BaseModel):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_output(self, max_bytes: int | None = None) -> StructuredOutputParams | None:
        """The one constraint this request asks for (400 if it asks for several, an invalid one, or one
        over `max_bytes` as JSON: compiling a grammar costs time that grows with its size)."""
        asked: list[tuple[str, dict[str, Any]]] = []
        if self.response_format is not None and self.response_format.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        if self.response_format is not None and self.response_format.json_schema is not None:
            schema = self.response_format.json_schema.schema_
            asked.append(("response_format", {"json": schema if schema is not None else {}}))
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(exclude_none=True)
            fields = {("json" if k == "json_" else k): v for k, v in fields.items() if v is not False}
            asked.append(("structured_outputs", fields))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                asked.append((f"guided_{name}", {name: value}))
        if not asked:
            return None
        if len(asked) > 1:
            names = ", ".join(name for name, _ in asked)
            raise APIError(400, f"ask for one kind of structured output, not several ({names})", param=asked[1][0])
        param, fields = asked[0]
        size = len(json.dumps(fields, ensure_ascii=False).encode())
        if max_bytes is not None and size > max_bytes:
            raise APIError(400, f"the structured-output constraint is {size} bytes; at most {max_bytes} are allowed",
                           param=param)  # fmt: skip
        try:
            return StructuredOutputParams(**fields)
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from exc


class Strict(RequestBody):
    _unsupported: tuple[str, ...] = ()

    def reject_unsupported(self) -> None:
        for name in self._unsupported:
            value = getattr(self, name)
            if value is not None and value != {} and value != []:
                raise APIError(400, f"'{name}' is not supported by this server", param=name, code="unsupported")


class SamplingFields(StructuredFields, Strict):
    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    speculate: bool = True  # folio's extension: false opts this request out of speculative decoding
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias

    def token_logit_bias(self, vocab_size: int) -> dict[int, float]:
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            # The length first: int() refuses more than 4,300 digits with its own error.
            if len(key) > len(str(vocab_size)) or not _TOKEN_ID.fullmatch(key) or int(key) >= vocab_size:
                raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}",
                               param="logit_bias")  # fmt: skip
            if not -100 <= value <= 100:
                raise APIError(400, f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias")
            bias[int(key)] = value
        return bias

    cache_salt: str | None = Field(None, min_length=1)  # prefix-cache isolation between tenants (as vLLM)
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)  # lower values are scheduled first and preempted last
    # Beam search (extension, as vLLM): the n best of beam_width beams (default n).
    use_beam_search: bool = False
    beam_width: int | None = Field(None, ge=1, le=MAX_N)
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    @model_validator(mode="after")
    def _check(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if self.beam_width is not None and not self.use_beam_search:
            raise ValueError("beam_width needs use_beam_search")
        if self.use_beam_search and (self.beam_width or self.n) < self.n:
            raise ValueError(f"beam_width must be at least n ({self.n})")
        return self

    def choice_params(
        self,
        limits: RequestLimits,
        vocab_size: int,
        max_tokens: int,
        num_samples: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        tool_constraint: StructuredOutputParams | None = None,
    ) -> list[SamplingParams]:
        """The engine parameters of every sample (sample j's seed is seed + j, so samples differ), checked
        whole (and against `limits`) before the call takes anything: the logit bias and the structured-output
        grammar are built once, shared. `tool_constraint` is the grammar of a forced tool call, which leaves
        no room for another."""
        limits.check_priority(self.priority)
        limits.check_stop(self.stop_list)
        limits.check_logit_bias(len(self.logit_bias or {}))
        logit_bias = self.token_logit_bias(vocab_size)
        structured = self.structured_output(limits.max_grammar_bytes)
        if tool_constraint is not None:
            if structured is not None:
                raise APIError(400, "a required or named tool_choice cannot be combined with structured output",
                               param="tool_choice")  # fmt: skip
            structured = tool_constraint
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                min_p=self.min_p or 0.0,
                seed=self.seed,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0,
                stop=self.stop_list,
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                logit_bias=logit_bias,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                use_beam_search=self.use_beam_search,
                beam_width=self.num_sequences if self.use_beam_search else None,
                length_penalty=self.length_penalty,
                early_stopping=self.early_stopping,
                structured_output=structured,
                speculate=self.speculate,
            )
            return [dataclasses.replace(params, seed=params.sample_seed(j)) for j in range(num_samples)]
        except ValueError as exc:  # a combination the engine refuses, e.g. beam search with penalties
            raise APIError(400, str(exc)) from exc

    @property
    def num_samples(self) -> int:
        """Samples per prompt (more than n for completions' best_of)."""
        return self.n

    @property
    def num_sequences(self) -> int:
        """Engine requests per prompt: a beam search runs beam_width beams, sampling one per sample."""
        return (self.beam_width or self.n) if self.use_beam_search else self.num_samples

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    _unsupported = ("suffix",)

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=INT64_MAX)
    echo: bool = False  # with logprobs: the prompt's tokens and logprobs come first, as OpenAI's legacy API
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's extension: per prompt token
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)  # sample this many, return the n most likely

    @property
    def num_prompt_logprobs(self) -> int | None:
        """How many alternatives each prompt token's logprob needs (None: prompt tokens are not scored)."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    @model_validator(mode="after")
    def _prompt_not_empty(self) -> CompletionRequest:
        if self.prompt == "" or self.prompt == [] or self.prompt == [[]]:
            raise ValueError("prompt must not be empty")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError("best_of must be at least n")
        if self.best_of is not None and self.use_beam_search:
            raise ValueError("best_of does not apply to beam search: set beam_width")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of cannot be streamed: the best choices are known only at the end")
        return self

    @property
    def num_samples(self) -> int:
        return self.best_of or self.n


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]
