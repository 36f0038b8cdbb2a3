"""One step on a pipeline stage: the step's tokens split into micro-batches that flow through the
stages one after another, so that stage 1 works on the first micro-batch while stage 0 works on the
second (GPipe's schedule, within a step).

Micro-batches are contiguous runs of the step's flat token batch of about equal size. A prompt chunk
may be cut between two of them: every stage runs its micro-batches in order, so the first piece's
keys and values are in that stage's cache before the second piece attends to them, exactly as in
chunked prefill. A chunk verifying drafts stays whole (its rows attend as decodes over one table).
The last stage concatenates its micro-batches' final hidden states, so the rows it samples from are
the step's rows as if it had run whole.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from folio.distributed.pipeline_parallel import PipelineStage
from folio.distributed.tensor_parallel import COMM
from folio.layers.attention.metadata import AttentionMetadata, build_attention_metadata
from folio.models.staged import StageCarry


@dataclass(frozen=True)
class Span:
    """Some of one request's scheduled tokens: positions [start, start + num_tokens)."""

    start: int
    num_tokens: int
    block_ids: list[int]
    keep_whole: bool = False  # a draft verification: never cut


@dataclass(frozen=True)
class MicroBatch:
    rows: slice  # of the step's flat batch
    meta: AttentionMetadata


def split_spans(spans: list[Span], count: int) -> list[list[Span]]:
    """At most `count` runs of about equal token counts, in order; spans cut where they must."""
    total = sum(span.num_tokens for span in spans)
    target = -(-total // max(1, min(count, total)))
    runs: list[list[Span]] = []
    current: list[Span] = []
    size = 0
    for span in spans:
        start, left = span.start, span.num_tokens
        while left:
            take = left if span.keep_whole else min(left, target - size)
            current.append(Span(start, take, span.block_ids, span.keep_whole))
            start, left, size = start + take, left - take, size + take
            if size >= target:
                runs.append(current)
                current, size = [], 0
    if current:
        runs.append(current)
    return runs


def micro_batches(spans: list[Span], count: int, block_size: int, device: torch.device) -> list[MicroBatch]:
    batches, row = [], 0
    for run in split_spans(spans, count):
        meta = build_attention_metadata([s.start for s in run], [s.num_tokens for s in run],
                                        [s.block_ids for s in run], block_size, device,
                                        as_decodes=[s.keep_whole for s in run])  # fmt: skip
        batches.append(MicroBatch(slice(row, row + meta.num_tokens), meta))
        row += meta.num_tokens
    return batches


def run_stage(
    model: torch.nn.Module,
    stage: PipelineStage,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    batches: list[MicroBatch],
    carry_shape: tuple[int, int],
    dtype: torch.dtype,
    in_transit: list[tuple[Any, torch.Tensor]],
) -> torch.Tensor | None:
    """This stage's part of the step: the final hidden states [T, hidden] on the last stage, None on
    the others (their results went to the next stage). `carry_shape`: (tensors per carry, hidden).

    `in_transit`: this stage's sends not yet received, kept across steps (each tensor must outlive its
    send). They are not waited for: with steps in flight the next stage may still be on the previous
    step, and waiting here would hold this stage back until it caught up."""
    in_transit[:] = [(work, packed) for work, packed in in_transit if not work.is_completed()]
    finished: list[torch.Tensor] = []
    parts, hidden_size = carry_shape
    for batch in batches:
        ids, pos = input_ids[batch.rows], positions[batch.rows]
        carried = None
        if not stage.is_first:
            carried = StageCarry.unpacked(stage.receive((parts, ids.shape[0], hidden_size), dtype, ids.device))
        result = model(ids, pos, batch.meta, carried)
        if stage.is_last:
            finished.append(result)
            continue
        packed = result.packed()
        assert packed.dtype == dtype and packed.shape[0] == parts, "a stage's carry is not what the next expects"
        started = time.perf_counter()
        in_transit.append((stage.send(packed), packed))
        COMM.add(started, packed)  # the bytes, and the time to post them
    return torch.cat(finished) if stage.is_last else None
