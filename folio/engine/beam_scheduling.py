"""Beam search inside the scheduler: live beams are ordinary running requests that share KV blocks.

A group starts as one root beam that computes the prompt. Each step every live beam reports its best
next tokens (`BeamCandidates`) and then waits, "parked", until its siblings have reported too; then
`BeamSearch.step` picks the next beams. A beam continued once keeps its request and blocks; a beam
continued k times forks k-1 children that hold its blocks by reference (the partial last block is
copied on write); a beam not continued frees its blocks. When the search ends, the caller's requests
(`results`) receive the best hypotheses and finish.

`BeamScheduling`, mixed into `Scheduler` and sharing its state, forks, drops, fails and finishes the beams.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from folio.engine.beam_search import BeamSearch
from folio.engine.request import FinishReason, Request, RequestStatus
from folio.step import BeamCandidates

if TYPE_CHECKING:
    from folio.engine.batching import BatchGate
    from folio.kv_cache.manager import KVCacheManager


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

    @property
    def ready(self) -> bool:
        return all(b.request_id in self.pending for b in self.beams)

    def new_beam(self, parent: Request) -> Request:
        """A request with the parent's tokens and settings (no blocks, nothing computed)."""
        beam = Request(
            f"{self.results[0].request_id}/beam-{next(self._ids)}",
            parent.prompt_token_ids,
            parent.sampling_params,
            eos_token_ids=parent.eos_token_ids,
            arrival_time=parent.arrival_time,
            cache_salt=parent.cache_salt,
            lora_name=parent.lora_name,
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


class BeamScheduling:
    _beam_groups: dict[str, BeamGroup]
    requests: dict[str, Request]
    running: list[Request]
    gate: BatchGate
    kv: KVCacheManager

    if TYPE_CHECKING:  # the Scheduler's own

        def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Request | None: ...

        def _enqueue(self, request: Request) -> None: ...

    def _abort_beam_result(self, result_id: str, reason: FinishReason) -> Request:
        """A caller gave up on one result of a beam search; the search stops with the last one."""
        group = self._beam_groups.pop(result_id)
        result = next(r for r in group.results if r.request_id == result_id)
        group.results.remove(result)
        result.finish(reason)
        if not group.results:
            for beam in group.beams:
                self.abort_request(beam.request_id)
        return result

    def _is_parked(self, request: Request) -> bool:
        """A beam that reported its candidates and waits for its siblings to report theirs."""
        group = self._beam_groups.get(request.request_id)
        return group is not None and request.request_id in group.pending

    def _num_beam_candidates(self, request: Request) -> int:
        group = self._beam_groups.get(request.request_id)
        return 0 if group is None else group.search.num_candidates

    def _advance_beams(self, group: BeamGroup, now: float) -> list[Request]:
        """Every live beam reported: run one beam-search step on the candidates and continue, fork and
        drop beams as it picked; return the results if the search ended."""
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
        for cont in live:
            parent = group.beams[cont.parent]
            if cont.parent in claimed:
                child = group.new_beam(parent)
                self._fork_beam(parent, child)  # before the parent's new token: the child starts from its state
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
        for beam in dropped:
            self.abort_request(beam.request_id)
        for result in finished:
            self._beam_groups.pop(result.request_id, None)
        return finished

    def _fork_beam(self, parent: Request, child: Request) -> None:
        """A new beam continues `parent`: it holds the parent's blocks if it has any, else it queues."""
        self.requests[child.request_id] = child
        self._beam_groups[child.request_id] = self._beam_groups[parent.request_id]
        self.gate.join(child.request_id)
        if parent.status is RequestStatus.RUNNING:
            self.kv.fork(parent.request_id, child.request_id)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        else:
            self._enqueue(child)

    def _fail_beam_group(self, group: BeamGroup, error: str, now: float) -> list[Request]:
        """A beam's row failed: the whole search ends with the error, its beams freed."""
        for beam in list(group.beams):
            self.abort_request(beam.request_id)
        for result in group.results:
            self._beam_groups.pop(result.request_id, None)
            result.fail(error, now)
        return list(group.results)


def finish_results(group: BeamGroup, now: float) -> list[Request]:
    """Give each result request its hypothesis (best first) and finish it."""
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
