"""Per-request sampling and stopping parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from folio.config import POOLING_METHODS
from folio.structured.params import StructuredOutputParams

MAX_LOGPROBS = 20  # top alternatives returned per token, as in OpenAI's chat API
# torch.Generator.manual_seed takes [-2**63, 2**64); the API takes int64 seeds (as vLLM) and sample j
# of a request draws with seed + j, which stays inside that range.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # top_k and priorities become int64 tensors or are compared so


@dataclass(frozen=True)
class PoolingParams:
    """Makes a request an embedding: its prompt is computed (prefill only) and its final hidden states,
    after the model's final norm, are pooled into one vector instead of sampling a token."""

    method: str | None = None  # "last" (the last prompt token) or "mean" (every prompt token); None: the engine's
    normalize: bool = True  # L2-normalise the pooled vector

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in POOLING_METHODS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_METHODS)}, got {self.method!r}")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    n: int = 1  # samples per prompt; they share the prompt's KV blocks (seeds seed, seed+1, ...)
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    # Penalties follow OpenAI (presence/frequency: subtracted from logits of tokens already generated)
    # and transformers (repetition: logits of tokens in the prompt or output divided or multiplied).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)  # stop strings, matched on the decoded text
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the sampled token's logprob plus the top k alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token (the first has none); as vLLM
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (OpenAI)
    speculate: bool = True  # with a speculative engine: False opts this request out of drafting
    # Beam search (transformers' semantics): the n best of beam_width beams (default: n). It is
    # deterministic, so temperature, top-k/p, min-p and seed do not apply.
    structured_output: StructuredOutputParams | None = None  # constrain the output (JSON schema, regex...)
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0  # hypothesis score = cumulative logprob / length ** length_penalty
    early_stopping: bool | Literal["never"] = False
    pooling: PoolingParams | None = None  # an embedding request: no token is sampled (see PoolingParams)

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "length_penalty"):  # fmt: skip
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not -1 <= self.top_k <= INT64_MAX:
            raise ValueError(f"top_k must be -1, 0 (off) or positive (at most {INT64_MAX}), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):  # NaN fails this too
            raise ValueError("logit_bias values must be in [-100, 100]")
        if any(not isinstance(t, int) or t < 0 for t in [*self.logit_bias, *self.stop_token_ids]):
            raise ValueError("logit_bias keys and stop_token_ids must be token ids (non-negative integers)")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.top_k == -1:
            self.top_k = 0
        self._check_beam_search()
        if self.pooling is not None and (self.n > 1 or self.use_beam_search or self.prompt_logprobs is not None
                                         or self.structured_output is not None):  # fmt: skip
            raise ValueError("an embedding request samples nothing: n, beam search, prompt_logprobs and structured "
                             "output do not apply")  # fmt: skip

    def _check_beam_search(self) -> None:
        if not self.use_beam_search:
            if self.beam_width is not None:
                raise ValueError("beam_width needs use_beam_search")
            return
        self.beam_width = self.beam_width or self.n
        if self.beam_width < self.n:
            raise ValueError(f"beam_width ({self.beam_width}) must be at least n ({self.n})")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")
        unsupported = {
            "penalties": self.has_penalties,
            "logit_bias": bool(self.logit_bias),
            "logprobs": self.logprobs is not None or self.prompt_logprobs is not None,
            "stop strings": bool(self.stop),
            "structured output": self.structured_output is not None,
        }
        for name, is_set in unsupported.items():
            if is_set:
                raise ValueError(f"beam search does not support {name}")
        self.temperature = 0.0  # the engine computes no sample for a beam, only its candidates

    def sample_seed(self, index: int) -> int | None:
        """The seed of sample `index` of a request: seed + index, wrapped to 64 bits as torch's
        generators wrap seeds (so -1 and 2**64 - 1 draw alike) and never out of their range."""
        return None if self.seed is None else (self.seed + index) % 2**64 if index else self.seed

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that reads or changes the logits first: the token is the raw argmax."""
        return self.greedy and not self.has_penalties and not self.logit_bias and self.logprobs is None

    @property
    def reads_every_prompt_position(self) -> bool:
        """Whether the request needs every prompt position computed (a cached block has no logits or hidden
        states): prompt logprobs and mean pooling (unresolved pooling counts, to be safe)."""
        return self.prompt_logprobs is not None or (self.pooling is not None and self.pooling.method != "last")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
