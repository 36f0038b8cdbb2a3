"""A step's flat batch: the scheduler's chunks laid end to end as token ids and positions, with the
attention metadata, and the rows that sample, score prompt tokens or verify drafts."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from folio.layers.attention.metadata import AttentionMetadata, build_grouped_metadata
from folio.step import SchedulerOutput
from folio.structured.grammar import unpack_bitmask
from folio.worker.pooling import PoolSpan
from folio.worker.request_states import RequestStates
from folio.worker.row_sampling import SampleSpec


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    # The row in [T] of each request that samples this step (a fork repeats its parent's), and aligned with
    # them the request ids and their sampling settings.
    logits_rows: list[int] = field(default_factory=list)
    sampled_ids: list[str] = field(default_factory=list)
    samplers: list[SampleSpec] = field(default_factory=list)
    # prompt_logprobs: the rows in [T] whose next prompt token is scored, that token, each request's slice.
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    prompt_scored: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Request id -> (first row in [T], k drafts): they verify on k + 1 rows; its grammar's masks [k + 1, V] bool.
    draft_rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    draft_masks: dict[str, torch.Tensor] = field(default_factory=dict)
    pooled: dict[str, PoolSpan] = field(default_factory=dict)  # embedding requests: their chunk's rows


def prepare_batch(
    out: SchedulerOutput, requests: RequestStates, vocab_size: int, block_size: int, device: torch.device
) -> BatchInputs:
    """Flatten the step's chunks into one batch; `requests` must already hold this step's update."""
    chunks = out.scheduled
    batch = BatchInputs(
        input_ids=torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=device),
        positions=torch.tensor([p for c in chunks for p in range(c.start_position, c.start_position + c.num_tokens)],
                               dtype=torch.long, device=device),
        meta=build_grouped_metadata([c.start_position for c in chunks], [c.num_tokens for c in chunks],
                                    [requests[c.request_id].block_tables for c in chunks], block_size, device,
                                    as_decodes=[c.num_draft_tokens > 0 for c in chunks]),
    )  # fmt: skip
    allowed = allowed_by_request(out, vocab_size)
    end_row = 0
    for chunk in chunks:
        state = requests[chunk.request_id]
        first_row, start, end = end_row, chunk.start_position, chunk.start_position + chunk.num_tokens
        end_row += chunk.num_tokens
        if state.sampling_params.prompt_logprobs is not None:
            last = min(end, state.num_prompt_tokens - 1)  # the last prompt token predicts no prompt token
            if last > start:
                scored = len(batch.prompt_rows)
                batch.prompt_scored[chunk.request_id] = (scored, scored + last - start)
                batch.prompt_rows.extend(range(first_row, first_row + last - start))
                batch.prompt_targets.extend(state.token_ids[start + 1 : last + 1])
        if (pooling := state.sampling_params.pooling) is not None:  # an embedding: no LM head, no sampling
            batch.pooled[chunk.request_id] = PoolSpan(first_row, end_row, start, chunk.needs_sample, pooling)
            continue
        if not chunk.needs_sample:
            continue
        if chunk.num_draft_tokens:  # verified on their own rows (spec_decode/verification.py), not sampled
            batch.draft_rows[chunk.request_id] = (end_row - 1 - chunk.num_draft_tokens, chunk.num_draft_tokens)
            if (mask := allowed.get(chunk.request_id)) is not None:
                batch.draft_masks[chunk.request_id] = mask
            continue
        for request_id in (chunk.request_id, *chunk.fork_ids):  # forks sample from their parent's row
            sampler = requests[request_id]
            batch.logits_rows.append(end_row - 1)
            batch.sampled_ids.append(request_id)
            beams = chunk.num_beam_candidates if request_id == chunk.request_id else 0
            # Only penalties read the tokens: copying a long context every step for nothing is waste.
            penalized = sampler.sampling_params.has_penalties
            prompt_ids = sampler.prompt_token_ids if penalized else []
            output_ids = sampler.output_token_ids if penalized else []
            mask = allowed.get(request_id)
            batch.samplers.append(
                SampleSpec(sampler.sampling_params, sampler.generator, prompt_ids, output_ids, beams,
                           None if mask is None else mask[0])
            )  # fmt: skip
    return batch


def allowed_by_request(out: SchedulerOutput, vocab_size: int) -> dict[str, torch.Tensor]:
    """Each constrained request's [rows, V] bool masks, unpacked from the step's grammar bitmask: one
    row, or k + 1 for a request verifying k drafts."""
    if out.grammar_bitmask is None:
        return {}
    allowed = unpack_bitmask(out.grammar_bitmask.bits, vocab_size)
    rows: dict[str, list[int]] = {}
    for row, request_id in enumerate(out.grammar_bitmask.request_ids):
        rows.setdefault(request_id, []).append(row)
    return {request_id: allowed[found] for request_id, found in rows.items()}
