"""Request bodies of the OpenAI-compatible API, validated by pydantic (out-of-range values -> 400).

Unknown fields are refused. OpenAI parameters folio does not implement are declared so that a request
setting one gets a 400 naming it (`reject_unsupported`), never a silent no-op; sending them as null
is the same as leaving them out.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from folio.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS, SamplingParams
from folio.server.errors import APIError
from folio.server.limits import RequestLimits
from folio.server.openai.chat.messages import ChatMessage
from folio.server.openai.structured_fields import StructuredFields
from folio.server.request_body import RequestBody
from folio.structured.params import StructuredOutputParams

MAX_N = 16  # choices per request
_TOKEN_ID = re.compile(r"0|[1-9][0-9]*")  # a logit_bias key: a token id in plain ASCII decimal


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


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
        """The engine parameters of every sample, checked whole (and against `limits`) before the call
        takes anything: the logit bias and the structured-output grammar are built once, shared.
        `tool_constraint` is the grammar of a forced tool call, which leaves no room for another."""
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
        return [
            self.sampling_params(max_tokens, j, logit_bias, logprobs, structured, prompt_logprobs)
            for j in range(num_samples)
        ]

    @property
    def num_sequences(self) -> int:
        """Engine requests per prompt: a beam search runs beam_width beams, sampling one per choice."""
        return (self.beam_width or self.n) if self.use_beam_search else self.n

    def sampling_params(
        self,
        max_tokens: int,
        choice: int,
        logit_bias: dict[int, float],
        logprobs: int | None,
        structured: StructuredOutputParams | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Engine parameters for sample `choice` of this request (seed + choice, so samples differ).
        `logit_bias` and `structured` (from `structured_output()`) are built once per request."""
        try:
            params = self._engine_params(max_tokens, logit_bias, logprobs, structured, prompt_logprobs)
            return dataclasses.replace(params, seed=params.sample_seed(choice)) if choice else params
        except ValueError as exc:  # a combination the engine refuses, e.g. beam search with penalties
            raise APIError(400, str(exc)) from exc

    def _engine_params(
        self,
        max_tokens: int,
        logit_bias: dict[int, float],
        logprobs: int | None,
        structured: StructuredOutputParams | None,
        prompt_logprobs: int | None,
    ) -> SamplingParams:
        return SamplingParams(
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
            beam_width=(self.beam_width or self.n) if self.use_beam_search else None,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            structured_output=structured,
            speculate=self.speculate,
        )

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

    @property
    def num_sequences(self) -> int:
        return (self.beam_width or self.n) if self.use_beam_search else self.num_samples


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
