"""What the offline API returns for each prompt."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """One generated token's log-probability and its most likely alternatives (best first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" (a fault ended it) | None while running
    logprobs: list[TokenLogprob] | None = None  # one per token id when SamplingParams.logprobs is set
    cumulative_logprob: float | None = None  # beam search: the hypothesis's summed token logprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # With SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text


@dataclass
class EmbeddingOutput:
    """What `LLM.embed` returns for each prompt: its pooled final hidden state."""

    request_id: str
    prompt: str | None  # None for a prompt given as token ids
    prompt_token_ids: list[int]
    embedding: list[float]  # hidden_size values; unit length when normalised

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
