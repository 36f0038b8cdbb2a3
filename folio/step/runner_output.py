"""What the model runner produced in one step, by request id, as plain values."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from folio.outputs import TokenLogprob


@dataclass(frozen=True)
class BeamCandidates:
    """One beam's best next tokens: log-softmax values and token ids, best first."""

    logprobs: torch.Tensor  # [k] float32
    token_ids: torch.Tensor  # [k] int64


@dataclass(frozen=True)
class ModelRunnerOutput:
    # The tokens each request gained this step (as vLLM's): one for a plain step; for a step that
    # verified drafts, the accepted drafts and then the target's own next token.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # one per token, for requests that asked
    # Per request that asked: the logprobs of the prompt tokens this step's chunk predicted, in order.
    prompt_logprobs: dict[str, tuple[TokenLogprob, ...]] = field(default_factory=dict)
    beam_candidates: dict[str, BeamCandidates] = field(default_factory=dict)  # for beams, instead of a token
    failed: dict[str, str] = field(default_factory=dict)  # request id -> what failed, in words fit for a client
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # speculative: proposed for the next step
    # Embedding requests whose prompt ended this step: the pooled hidden state, [hidden] float32 on the CPU.
    embeddings: dict[str, torch.Tensor] = field(default_factory=dict)
