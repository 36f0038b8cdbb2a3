"""The values that cross the scheduler/runner boundary in one engine step.

Both sides import this module and nothing of each other's: the scheduler's decision (`SchedulerOutput`)
goes to the runner, in this process or to a worker's ranks, and what the runner produced
(`ModelRunnerOutput`, by request id) comes back.

A request's data goes to the runner once, the first step it is scheduled (`NewRequestData`); after
that each step carries only what changed (`ScheduledChunk`): the tokens to compute and the block ids
that changed. The runner keeps what it was sent, keyed by request id, until the request's id appears
in `finished_request_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from folio.kv_cache.tier_ops import TierOps
from folio.outputs import TokenLogprob
from folio.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """What the runner keeps about a request: sent once, the first step it is scheduled or forked."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # generated before the runner met it (a beam forked mid-search)
    sampling_params: SamplingParams
    lora_name: str | None = None  # the LoRA adapter its rows run with (registered with the runner's store)


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's part of the step: tokens [start_position, start_position + len(token_ids))."""

    request_id: str
    token_ids: list[int]  # a fresh list, never aliased to the request's own
    start_position: int  # = tokens already in the KV cache
    # The block tables changed from index `first_new_block` on: these ids replace their tails, one tuple
    # per KV cache group (a grown sequence appends; a copy-on-write replaces its last block; a window
    # group's blocks out of the window become the placeholder; a resumed request resends them all).
    first_new_block: int
    new_block_ids: tuple[tuple[int, ...], ...]
    needs_sample: bool  # the chunk reaches the end of the sequence, so a new token is sampled
    fork_ids: tuple[str, ...] = ()  # forks that sample their first token from this request's row
    num_beam_candidates: int = 0  # a beam: report this many best next tokens instead of sampling one
    num_draft_tokens: int = 0  # the last this many token_ids are drafts for the target to verify

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class GrammarBitmask:
    """Structured output: which tokens each constrained row may sample next, 32 tokens a word (bit set:
    allowed). Computed on the scheduler's side, where the grammars live; the runner only applies it."""

    # Row i of `bits` belongs to request_ids[i]; a request verifying k drafts has k + 1 consecutive rows
    # (what may follow its last token, then each draft in turn).
    request_ids: tuple[str, ...]
    bits: torch.Tensor  # [rows, ceil(vocab / 32)] int32


@dataclass(frozen=True)
class SchedulerOutput:
    new_requests: tuple[NewRequestData, ...] = ()
    scheduled: tuple[ScheduledChunk, ...] = ()
    preempted_ids: tuple[str, ...] = ()
    finished_request_ids: frozenset[str] = frozenset()  # ended since the last step: the runner forgets them
    block_copies: tuple[tuple[int, int], ...] = ()  # (src, dst): copy-on-write, before the forward
    tier_ops: TierOps = TierOps()  # the KV tiers' saves, copies and reads, before everything else
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


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
