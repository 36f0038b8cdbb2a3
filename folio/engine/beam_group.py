"""Beam search inside the scheduler: live beams are ordinary running requests that share KV blocks.

A group starts as one root beam that computes the prompt. Each step every live beam reports its best
next tokens (`BeamCandidates`) and then waits, "parked", until its siblings have reported too; then
`BeamSearch.step` picks the next beams. A beam continued once keeps its request and blocks; a beam
continued k times forks k-1 children that hold its blocks by reference (the partial last block is
copied on write); a beam not continued frees its blocks. When the search ends, the caller's requests
(`results`) receive the best hypotheses and finish.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from folio.engine.beam_search import BeamSearch
from folio.engine.request import FinishReason, Request
from folio.step import BeamCandidates


@dataclass(eq=False)
class BeamGroup:
    results: list[Request]  # what the caller waits on: the n best hypotheses, filled at the end
    search: BeamSearch
    beams: list[Request] = field(default_factory=list)  # live beams, best first
    scores: list[float] = field(default_factory=list)  # their cumulative logprobs
    pending: dict[str, BeamCandidates] = field(default_factory=dict)  # candidates reported this round
    first_scheduled_time: float | None = None  # of the root beam: end of the group's queueing
    first_token_time: float | None = None  # the first round: the group's first tokens
    num_cached_tokens: int = 0  # of the prompt, tokens the root beam found in the prefix cache
    num_preemptions: int = 0
    _ids: itertools.count = field(default_factory=itertools.count)

    def new_beam_id(self) -> str:
        return f"{self.results[0].request_id}/beam-{next(self._ids)}"

    @property
    def ready(self) -> bool:
        return all(b.request_id in self.pending for b in self.beams)

    def new_beam(self, parent: Request) -> Request:
        """A request with the parent's tokens and settings (no blocks, nothing computed)."""
        beam = Request(
            self.new_beam_id(),
            parent.prompt_token_ids,
            parent.sampling_params,
            eos_token_ids=parent.eos_token_ids,
            arrival_time=parent.arrival_time,
            cache_salt=parent.cache_salt,
            priority=parent.priority,
        )
        beam.arrival_order = parent.arrival_order  # siblings queue where the group queued
        beam.output_token_ids = list(parent.output_token_ids)
        beam.block_keys = list(parent.block_keys)
        beam.first_scheduled_time = parent.first_scheduled_time
        return beam


def start_group(results: list[Request], max_model_len: int) -> BeamGroup:
    first = results[0]
    params = first.sampling_params
    if params.beam_width is None or len(results) > params.beam_width:
        raise ValueError(f"beam search returns at most beam_width ({params.beam_width}) results, not {len(results)}")
    search = BeamSearch(
        beam_width=params.beam_width,
        max_new_tokens=min(params.max_tokens, max_model_len - first.num_prompt_tokens),
        eos_token_ids=frozenset() if params.ignore_eos else first.eos_token_ids | frozenset(params.stop_token_ids),
        length_penalty=params.length_penalty,
        early_stopping=params.early_stopping,
    )
    group = BeamGroup(results, search)
    group.beams = [group.new_beam(first)]
    group.scores = [0.0]
    return group


@dataclass
class BeamAdvance:
    """What one round of a group changed, for the scheduler to apply."""

    forks: list[tuple[Request, Request]]  # (parent, child): the child shares the parent's blocks
    dropped: list[Request]  # beams not continued
    finished: list[Request]  # the results, when the search ended


def advance(group: BeamGroup, now: float, fork: Callable[[Request, Request], None]) -> BeamAdvance:
    """Run one beam-search step on the reported candidates. `fork(parent, child)` is called before
    the parent's new token is appended, so the child starts from the parent's current state."""
    live = group.search.step(
        [(b.output_token_ids, s) for b, s in zip(group.beams, group.scores, strict=True)],
        [group.pending[b.request_id] for b in group.beams],
    )
    group.pending.clear()
    if group.first_token_time is None:
        root = group.beams[0]
        group.first_token_time, group.first_scheduled_time = now, root.first_scheduled_time
        group.num_cached_tokens = root.num_cached_tokens
    claimed: set[int] = set()
    plan: list[tuple[Request, int]] = []
    forks: list[tuple[Request, Request]] = []
    for cont in live:
        parent = group.beams[cont.parent]
        if cont.parent in claimed:
            child = group.new_beam(parent)
            fork(parent, child)
            forks.append((parent, child))
            plan.append((child, cont.token_id))
        else:
            claimed.add(cont.parent)
            plan.append((parent, cont.token_id))
    dropped = [b for i, b in enumerate(group.beams) if i not in claimed]
    for beam, token in plan:
        beam.output_token_ids.append(token)
    group.beams = [beam for beam, _ in plan]
    group.scores = [cont.cumulative_logprob for cont in live]
    finished = finish_results(group, now) if group.search.done else []
    return BeamAdvance(forks, dropped, finished)


def finish_results(group: BeamGroup, now: float | None = None) -> list[Request]:
    """Give each result request its hypothesis (best first) and finish it."""
    now = time.monotonic() if now is None else now
    hypotheses = group.search.best(len(group.results))
    for index, result in enumerate(group.results):
        result.first_scheduled_time = group.first_scheduled_time
        result.first_token_time = group.first_token_time
        result.num_cached_tokens = group.num_cached_tokens
        result.num_preemptions = group.num_preemptions
        if index >= len(hypotheses):  # only if the vocabulary is smaller than the candidates asked for
            result.finish(FinishReason.ABORT, now)
            continue
        hypothesis = hypotheses[index]
        result.output_token_ids = list(hypothesis.token_ids)
        result.cumulative_logprob = hypothesis.cumulative_logprob
        result.finish(FinishReason.STOP if hypothesis.ended_with_eos else FinishReason.LENGTH, now)
    return list(group.results)
