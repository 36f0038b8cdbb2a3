"""The runner's persistent per-request state, kept across steps and keyed by request id.

The scheduler sends a request's data once (`NewRequestData`) and then per-step changes; this is where
the runner keeps them: the tokens it has seen, its block tables, its sampling parameters and its seeded
generator. A preempted request keeps its state (its generator draws on where it left off); a finished
one is dropped when its id arrives in `finished_request_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from folio.sampling_params import SamplingParams
from folio.step import NewRequestData, SchedulerOutput


@dataclass
class RunningSum:
    """Mean pooling's state between an embedding request's chunks: the sum of its rows so far, in float32."""

    total: torch.Tensor  # [hidden]
    count: int

    def add(self, rows: torch.Tensor) -> None:
        self.total += rows.float().sum(dim=0)
        self.count += rows.shape[0]


@dataclass
class RequestState:
    request_id: str
    num_prompt_tokens: int
    token_ids: list[int]  # prompt + output, as far as the scheduler has sent them
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_tables: list[list[int]]  # one per KV cache group
    draft_length: int = 0  # speculative decoding: drafts to propose next (set by the runner)
    pool_sum: RunningSum | None = None  # an embedding request's mean pooling, while its prompt is computed
    lora_name: str | None = None  # the LoRA adapter its rows run with

    @classmethod
    def from_new(cls, data: NewRequestData) -> RequestState:
        seed = data.sampling_params.seed
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        tokens = [*data.prompt_token_ids, *data.output_token_ids]
        return cls(data.request_id, len(data.prompt_token_ids), tokens, data.sampling_params, generator, [],
                   lora_name=data.lora_name)  # fmt: skip

    @property
    def block_ids(self) -> list[int]:
        """The first group's block table: the only one of a model with one KV cache group (a split model
        always has one)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class RequestStates:
    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}

    def __getitem__(self, request_id: str) -> RequestState:
        return self.states[request_id]

    def __len__(self) -> int:
        return len(self.states)

    def update(self, out: SchedulerOutput) -> list[RequestState]:
        """Apply one step's changes: forget finished requests (returned), meet new ones, take each
        chunk's tokens and block table changes."""
        finished = [state for rid in out.finished_request_ids if (state := self.states.pop(rid, None)) is not None]
        for data in out.new_requests:
            self.states[data.request_id] = RequestState.from_new(data)
        for chunk in out.scheduled:
            state = self.states[chunk.request_id]
            # A prompt's later chunks are already known from NewRequestData: replace this chunk's span,
            # and past the prompt drop what lies beyond it (drafts rejected in an earlier step).
            end = chunk.start_position + chunk.num_tokens
            state.token_ids[chunk.start_position : end] = chunk.token_ids
            del state.token_ids[max(end, state.num_prompt_tokens) :]
            tables = state.block_tables
            tables.extend([] for _ in range(len(chunk.new_block_ids) - len(tables)))
            for table, ids in zip(tables, chunk.new_block_ids, strict=True):
                table[chunk.first_new_block :] = ids
        return finished
