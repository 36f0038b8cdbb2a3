"""A request's state as the scheduler and engine see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from folio.kv_cache.hashing import BlockKey
from folio.outputs import TokenLogprob
from folio.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from folio.structured.grammar import TokenGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"
    ERROR = "error"  # a fault inside the engine ended this request (its batch went on)


@dataclass(eq=False)  # identity: requests are compared and removed from lists by object
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None  # keeps a tenant's prefix cache apart from others'
    priority: int = 0  # lower is more urgent: admitted first, preempted last
    lora_name: str | None = None  # the LoRA adapter it runs with (EngineCore.add_lora registered it)
    arrival_order: int = 0  # set by the scheduler

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # filled when params.logprobs is set
    # With params.prompt_logprobs: one per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    cumulative_logprob: float | None = None  # set on a beam search's results
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of the prompt, tokens whose KV came from the prefix cache
    block_keys: list[BlockKey] = field(default_factory=list)  # prefix-cache keys of its full blocks
    forks: list[Request] = field(default_factory=list)  # samples waiting to share this request's prompt
    spec_token_ids: list[int] = field(default_factory=list)  # drafts proposed for its next step
    finish_reason: FinishReason | None = None
    first_scheduled_time: float | None = None  # end of queueing, for the queue-time metric
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    grammar: TokenGrammar | None = None  # structured output: what the output may continue with
    error: str | None = None  # with FinishReason.ERROR: what failed, in words fit for the client
    embedding: torch.Tensor | None = None  # an embedding request's pooled vector, once its prompt is computed

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefix_salt(self) -> str | None:
        """What keeps its prefix-cache blocks apart besides their tokens: the tenant's salt, and the adapter
        (its KV is not the base model's). repr() quotes each, so no two pairs give one salt."""
        if self.lora_name is None:
            return self.cache_salt
        return f"{self.cache_salt!r} lora {self.lora_name!r}"

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int, max_model_len: int, logprob: TokenLogprob | None = None) -> None:
        """Record a sampled token and decide whether the request is done."""
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        params = self.sampling_params
        # A grammar that cannot go on (its language ends here, or it refused the token) ends the output.
        grammar_ended = self.grammar is not None and (not self.grammar.accept(token_id) or self.grammar.is_finished)
        eos = not params.ignore_eos and token_id in self.eos_token_ids
        if eos or token_id in params.stop_token_ids or grammar_ended:
            self.finish(FinishReason.STOP, now)
        elif len(self.output_token_ids) >= params.max_tokens or self.num_tokens >= max_model_len:
            self.finish(FinishReason.LENGTH, now)

    def __post_init__(self) -> None:
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs.append(None)  # the first token: nothing predicts it

    def add_prompt_logprobs(self, start: int, scored: tuple[TokenLogprob, ...]) -> None:
        """Logprobs of prompt tokens start + 1, start + 2, ... (a chunk from `start` predicted them).
        A request recomputed after a preemption scores its prompt again; the first scores are kept."""
        for offset, logprob in enumerate(scored):
            if start + 1 + offset == len(self.prompt_logprobs):
                self.prompt_logprobs.append(logprob)

    def take_embedding(self, vector: torch.Tensor, now: float | None = None) -> None:
        """An embedding request is done once its prompt is computed and pooled."""
        self.embedding = vector
        self.finish(FinishReason.STOP, now)

    def fail(self, error: str, now: float | None = None) -> None:
        self.error = error
        self.finish(FinishReason.ERROR, now)

    def finish(self, reason: FinishReason, now: float | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.monotonic() if now is None else now
