"""A step's flat batch: the scheduler's chunks laid end to end as token ids and positions, with the
attention metadata, and the rows that sample, score prompt tokens or verify drafts."""

from __future__ import annotations

from dataclasses import dataclass

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
    logits_rows: list[int]  # row in [T] of each request that samples this step (a fork repeats its parent's)
    sampled_ids: list[str]  # request ids, aligned with logits_rows
    samplers: list[SampleSpec]  # sampling settings, aligned with logits_rows
    prompt_rows: list[int]  # rows in [T] whose next prompt token is scored (prompt_logprobs)
    prompt_targets: list[int]  # that next prompt token, aligned with prompt_rows
    prompt_scored: dict[str, tuple[int, int]]  # request id -> its slice of prompt_rows
    draft_rows: dict[str, tuple[int, int]]  # request id -> (first row in [T], drafts): k drafts verify on k + 1 rows
    draft_masks: dict[str, torch.Tensor]  # request id -> [k + 1, V] bool: its grammar's masks at those rows
    pooled: dict[str, PoolSpan]  # embedding requests: their chunk's rows, pooled instead of sampled


def prepare_batch(
    out: SchedulerOutput, requests: RequestStates, vocab_size: int, block_size: int, device: torch.device
) -> BatchInputs:
    """Flatten the step's chunks into one batch; `requests` must already hold this step's update."""
    input_ids: list[int] = []
    positions: list[int] = []
    logits_rows: list[int] = []
    sampled_ids: list[str] = []
    samplers: list[SampleSpec] = []
    prompt_rows: list[int] = []
    prompt_targets: list[int] = []
    prompt_scored: dict[str, tuple[int, int]] = {}
    draft_rows: dict[str, tuple[int, int]] = {}
    draft_masks: dict[str, torch.Tensor] = {}
    pooled: dict[str, PoolSpan] = {}
    allowed = allowed_by_request(out, vocab_size)
    for chunk in out.scheduled:
        state = requests[chunk.request_id]
        first_row, start, end = len(input_ids), chunk.start_position, chunk.start_position + chunk.num_tokens
        input_ids.extend(chunk.token_ids)
        positions.extend(range(start, end))
        if state.sampling_params.prompt_logprobs is not None:
            last = min(end, state.num_prompt_tokens - 1)  # the last prompt token predicts no prompt token
            if last > start:
                prompt_scored[chunk.request_id] = (len(prompt_rows), len(prompt_rows) + last - start)
                prompt_rows.extend(range(first_row, first_row + last - start))
                prompt_targets.extend(state.token_ids[start + 1 : last + 1])
        if (pooling := state.sampling_params.pooling) is not None:  # an embedding: no LM head, no sampling
            pooled[chunk.request_id] = PoolSpan(first_row, len(input_ids), start, chunk.needs_sample, pooling)
            continue
        if not chunk.needs_sample:
            continue
        if chunk.num_draft_tokens:  # verified on their own rows (draft_verification.py), not sampled
            draft_rows[chunk.request_id] = (len(input_ids) - 1 - chunk.num_draft_tokens, chunk.num_draft_tokens)
            if (mask := allowed.get(chunk.request_id)) is not None:
                draft_masks[chunk.request_id] = mask
            continue
        for request_id in (chunk.request_id, *chunk.fork_ids):  # forks sample from their parent's row
            sampler = requests[request_id]
            logits_rows.append(len(input_ids) - 1)
            sampled_ids.append(request_id)
            beams = chunk.num_beam_candidates if request_id == chunk.request_id else 0
            # Only penalties read the tokens: copying a long context every step for nothing is waste.
            penalized = sampler.sampling_params.has_penalties
            prompt_ids = sampler.prompt_token_ids if penalized else []
            output_ids = sampler.output_token_ids if penalized else []
            mask = allowed.get(request_id)
            samplers.append(
                SampleSpec(sampler.sampling_params, sampler.generator, prompt_ids, output_ids, beams,
                           None if mask is None else mask[0])
            )  # fmt: skip
    meta = build_grouped_metadata(
        [c.start_position for c in out.scheduled],
        [c.num_tokens for c in out.scheduled],
        [requests[c.request_id].block_tables for c in out.scheduled],
        block_size,
        device,
        as_decodes=[c.num_draft_tokens > 0 for c in out.scheduled],
    )
    return BatchInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=meta,
        logits_rows=logits_rows,
        sampled_ids=sampled_ids,
        samplers=samplers,
        prompt_rows=prompt_rows,
        prompt_targets=prompt_targets,
        prompt_scored=prompt_scored,
        draft_rows=draft_rows,
        draft_masks=draft_masks,
        pooled=pooled,
    )


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
