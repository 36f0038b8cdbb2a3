"""Iteration-level scheduling with one token budget per step.

There are no prefill or decode phases: every request has `num_computed_tokens` and `num_tokens`, and
each step gives running requests their next tokens first (1 for a decode, a chunk for a prompt that is
still being prefilled), then admits waiting requests while budget, sequence slots and KV blocks last.
When a running request needs a block and none is free, the least urgent request not yet given tokens
this step (the largest (priority, arrival): the lowest priority, then the latest arrival) is preempted:
its blocks are freed and it goes back to the queue at its arrival place, ahead of later arrivals, to be
recomputed.
Beam search groups run their beams as ordinary requests (see beam_scheduling.py).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time

from folio.config import SchedulerConfig
from folio.engine.batching import BatchGate
from folio.engine.beam_scheduling import BeamGroup, BeamScheduling, start_group
from folio.engine.request import FinishReason, Request, RequestStatus
from folio.engine.runner_view import RunnerView
from folio.engine.stats import SchedulerStats, read_stats
from folio.engine.structured_output import StructuredOutputManager
from folio.kv_cache.manager import KVCacheManager
from folio.outputs import TokenLogprob
from folio.spec_decode.scheduling import SpecDecodeStats, drafts_to_verify
from folio.step import ModelRunnerOutput, NewRequestData, ScheduledChunk, SchedulerOutput
from folio.structured.grammar import TokenGrammar

logger = logging.getLogger("folio")


def _queue_order(request: Request) -> tuple[int, int]:
    """Lower priority values first (as vLLM), then arrival."""
    return request.priority, request.arrival_order


class Scheduler(BeamScheduling):
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, vocab_size: int | None = None) -> None:
        self.config = config
        self.kv = kv_manager
        self.structured = StructuredOutputManager(vocab_size)
        self.waiting: list[Request] = []  # kept in admission order: (priority, arrival)
        batch_size = min(config.batch_size or config.max_num_seqs, config.max_num_seqs)
        self.gate = BatchGate(config.batching, batch_size, config.batch_timeout)
        self._arrivals = itertools.count()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every scheduled request, live beams included
        self._beam_groups: dict[str, BeamGroup] = {}  # by the request id of each live beam and each result
        self.num_preemptions = 0
        self.spec_stats = SpecDecodeStats()
        self.runner_view = RunnerView()  # what the runner holds, so each step sends only changes
        # Requests in a step whose result has not come back (a pipeline runs several steps at once):
        # they get no tokens and are never preempted until it does.
        self.in_flight: set[str] = set()

    def make_stats(self) -> SchedulerStats:
        """This moment's counters and gauges, as a value (metrics, replicas' load, benchmarks)."""
        return read_stats(self)

    # -- queue management --------------------------------------------------------------------------
    def add_request(self, request: Request, forks: list[Request] | None = None) -> None:
        """Queue a request. `forks` are further samples of the same prompt: they wait until the request
        samples its first token, then share its prompt blocks instead of computing the prompt again."""
        group = [request, *(forks or [])]
        for r in group:
            if r.request_id in self.requests or r.request_id in self._beam_groups:
                raise ValueError(f"request id {r.request_id!r} is already in use")
            r.arrival_order = next(self._arrivals)
        if request.sampling_params.use_beam_search:  # the samples are the results of one search
            beams = start_group(group, self.config.max_model_len)
            self._beam_groups.update({r.request_id: beams for r in [*group, *beams.beams]})
            request, group = beams.beams[0], beams.beams
        else:
            request.forks = list(forks or [])
        for r in group:
            self.requests[r.request_id] = r
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        # A preempted request keeps its arrival number, so it goes back ahead of later arrivals.
        bisect.insort(self.waiting, request, key=_queue_order)

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        """Drop a request and free its blocks; `reason` is STOP when a stop string ended it."""
        if request_id in self._beam_groups and request_id not in self.requests:
            return self._abort_beam_result(request_id, reason)
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._beam_groups.pop(request_id, None)
        self._release_forks(request)
        for parent in [*self.running, *self.waiting]:
            if request in parent.forks:  # a fork that never started
                parent.forks.remove(request)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request_id)  # an in-flight step may still write them: ranks run steps in order
        self.runner_view.finished(request_id)
        self.gate.leave(request_id)
        self.in_flight.discard(request_id)
        if not request.is_finished:
            request.finish(reason)
        return request

    def seconds_until_batch(self) -> float | None:
        """With nothing running: how long until the batching policy starts a batch (None: on arrivals)."""
        return self.gate.seconds_until_ready(self.waiting, time.monotonic())

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Serve the running requests (preempting when blocks run out), then admit waiting ones."""
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=_queue_order)  # budget goes to the most urgent first
        preempted = self._preempt_for_priority(budget)
        made_room = len(preempted)
        chosen: list[tuple[Request, int]] = []
        budget = self._schedule_running(budget, chosen, preempted)
        # Admit waiting requests only when nobody was preempted for blocks, so a freed block is not
        # handed straight to a newcomer while the preempted request waits.
        if len(preempted) == made_room:
            self._schedule_waiting(budget, chosen, preempted)
        return self._output(chosen, preempted)

    def _schedule_running(self, budget: int, chosen: list[tuple[Request, int]], preempted: list[Request]) -> int:
        """Give running requests their next tokens, most urgent first; when a request needs a block and
        none is free, preempt the least urgent request not yet given tokens this step."""
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._is_parked(request) or request.request_id in self.in_flight:
                index += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            start = request.num_computed_tokens
            drafts = drafts_to_verify(request, budget, self.config.max_model_len)
            if drafts and not self.kv.allocate_slots(
                request.request_id, start + num_new + len(drafts), write_from=start
            ):
                drafts = []  # no blocks for the drafts: verify none rather than preempt anyone for them
            request.spec_token_ids = drafts
            num_new += len(drafts)
            while not self.kv.allocate_slots(request.request_id, start + num_new, write_from=start):
                victim = max(self._preemptible(self.running[index:]), key=_queue_order)  # maybe this request itself
                self._preempt(victim, preempted)
                if victim is request:
                    return budget  # nothing after it can run either
            chosen.append((request, num_new))
            budget -= num_new
            index += 1
        return budget

    def _preemptible(self, requests: list[Request]) -> list[Request]:
        return [r for r in requests if r.request_id not in self.in_flight]

    def _schedule_waiting(self, budget: int, chosen: list[tuple[Request, int]], preempted: list[Request]) -> None:
        self.gate.maybe_form(self.waiting, time.monotonic())
        budget = self._admit(budget, chosen)
        # Parked beams may hold the blocks the beams they wait for need: give one's up.
        while not chosen and (parked := [r for r in self.running if self._is_parked(r)]):
            if not any(self.gate.admits(r) and not self._is_parked(r) for r in self.waiting):
                break
            self._preempt(max(parked, key=_queue_order), preempted)
            budget = self._admit(budget, chosen)

    def _output(self, chosen: list[tuple[Request, int]], preempted: list[Request]) -> SchedulerOutput:
        """The step as values: new requests' data once, then each chunk's tokens and block changes."""
        new_requests: list[NewRequestData] = []
        chunks: list[ScheduledChunk] = []
        constrained: list[tuple[str, TokenGrammar, list[int]]] = []
        for request, num_new in chosen:
            start = request.num_computed_tokens
            end = min(start + num_new, request.num_tokens)
            drafts = request.spec_token_ids[: start + num_new - end]
            needs_sample = end == request.num_tokens
            forks: list[Request] = []
            if request.forks and needs_sample and not request.output_token_ids:
                forks = self._forks_to_sample(request)
            for r in [request, *forks]:
                if (data := self.runner_view.new_request_data(r)) is not None:
                    new_requests.append(data)
                if needs_sample and r.grammar is not None:
                    constrained.append((r.request_id, r.grammar, drafts if r is request else []))
            first_new_block, new_block_ids = self.runner_view.block_changes(
                request.request_id, self.kv.tables_of(request.request_id)
            )
            chunks.append(
                ScheduledChunk(
                    request_id=request.request_id,
                    token_ids=request.token_ids_between(start, end) + drafts,
                    start_position=start,
                    first_new_block=first_new_block,
                    new_block_ids=new_block_ids,
                    needs_sample=needs_sample,
                    fork_ids=tuple(f.request_id for f in forks),
                    num_beam_candidates=self._num_beam_candidates(request),
                    num_draft_tokens=len(drafts),
                )
            )
        self.in_flight.update(request_id for c in chunks for request_id in (c.request_id, *c.fork_ids))
        return SchedulerOutput(
            new_requests=tuple(new_requests),
            scheduled=tuple(chunks),
            preempted_ids=tuple(r.request_id for r in preempted),
            finished_request_ids=self.runner_view.take_finished(),
            block_copies=tuple(self.kv.take_copies()),
            tier_ops=self.kv.take_tier_ops(),
            grammar_bitmask=self.structured.bitmask(constrained),
        )

    def _admit(self, budget: int, chosen: list[tuple[Request, int]]) -> int:
        """Move waiting requests to running while budget, sequence slots and blocks last."""
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = next((r for r in self.waiting if self.gate.admits(r) and not self._is_parked(r)
                            and self._adapter_fits(r) and self.kv.tiers_ready(r)), None)  # fmt: skip
            if request is None:
                break
            # A cached block has no logits or hidden states: a request scoring its prompt or mean-pooling it
            # computes all of it. (Embeddings fill the cache like any prompt: their KV is a generation's.)
            whole = request.sampling_params.reads_every_prompt_position
            cached = [] if whole else self.kv.find_cached_prefix(request)
            from_tier = [] if whole else self.kv.find_in_tier(request, len(cached[0]) if cached else 0)
            num_cached = ((len(cached[0]) if cached else 0) + len(from_tier)) * self.kv.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(request.request_id, num_cached + num_new, cached, from_tier=from_tier):
                break
            self.kv.record_lookup(request.num_tokens, num_cached)
            request.num_computed_tokens = num_cached
            if request.first_scheduled_time is None:  # the first admission: prompt tokens only
                request.num_cached_tokens = num_cached
                request.first_scheduled_time = time.monotonic()
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chosen.append((request, num_new))
            budget -= num_new
        return budget

    def _adapter_fits(self, request: Request) -> bool:
        """Whether its LoRA adapter fits beside the running requests' (at most max_loras in a batch, as vLLM
        admits them); one that does not waits, and requests behind it may go first."""
        limit = self.config.max_loras
        if request.lora_name is None or limit is None:
            return True
        running = {r.lora_name for r in self.running if r.lora_name is not None}
        return request.lora_name in running or len(running) < limit

    def _forks_to_sample(self, request: Request) -> list[Request]:
        """Forks that sample alongside the request's first token; if the running batch has no room for
        them, they become ordinary requests instead (the prefix cache still shares its full blocks)."""
        if len(self.running) + len(request.forks) > self.config.max_num_seqs:
            self._release_forks(request)
            return []
        return list(request.forks)

    def _release_forks(self, request: Request) -> None:
        for fork in request.forks:
            self.gate.join(fork.request_id)
            self._enqueue(fork)
        request.forks = []

    def _start_forks(self, parent: Request, item: ScheduledChunk, now: float) -> list[Request]:
        """Forks sampled this step join the running batch holding the parent's blocks."""
        started = []
        for fork_id in item.fork_ids:
            fork = self.requests.get(fork_id)
            if fork is None or fork not in parent.forks:  # aborted meanwhile
                continue
            self.kv.fork(parent.request_id, fork.request_id)
            self.gate.join(fork.request_id)
            fork.num_computed_tokens = parent.num_computed_tokens
            fork.status = RequestStatus.RUNNING
            fork.first_scheduled_time = now
            self.running.append(fork)
            started.append(fork)
        parent.forks = []
        return started

    def _append_token(self, request: Request, token: int, logprob: TokenLogprob | None) -> None:
        try:
            request.append_output_token(token, self.config.max_model_len, logprob)
        except Exception:  # e.g. its grammar failed to advance: this request ends, its batch goes on
            logger.exception("request %s failed to take its sampled token", request.request_id)
            request.fail("the sampled token could not be applied")

    def _preempt(self, request: Request, preempted: list[Request]) -> None:
        """Take a running request off the batch, free its blocks and requeue it (noted in `preempted`)."""
        self.running.remove(request)
        preempted.append(request)
        if (group := self._beam_groups.get(request.request_id)) is not None:
            group.num_preemptions += 1
        self.kv.free(request.request_id)
        self.runner_view.preempted(request.request_id)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)

    def _preempt_for_priority(self, budget: int) -> list[Request]:
        """While the most urgent waiting request outranks a running one and lacks a sequence slot or
        the blocks for its first chunk, preempt the least urgent running request for it."""
        victims: list[Request] = []
        while self.waiting and (candidates := self._preemptible(self.running)):
            head, worst = self.waiting[0], candidates[-1]
            if worst.priority <= head.priority:
                break
            chunk = min(head.num_tokens - head.num_computed_tokens, budget)
            has_slot = len(self.running) < self.config.max_num_seqs
            if has_slot and self.kv.blocks_needed(chunk) * self.kv.num_groups <= self.kv.pool.num_free_blocks:
                break
            self._preempt(worst, victims)
        return victims

    def update_from_output(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance computed counts, append sampled tokens, retire finished requests.

        Returns the requests that produced a token this step (finished ones included); a beam search's
        results appear once, finished, when the search ends. A request in `result.failed` (its row
        faulted) finishes with an error and gets no token; the rest of the batch goes on.
        """
        updated: list[Request] = []
        sampled, failed, logprobs = result.sampled_token_ids, result.failed, result.logprobs
        now = time.monotonic()
        for item in output.scheduled:
            self.in_flight.discard(item.request_id)
            self.in_flight.difference_update(item.fork_ids)
            request = self.requests.get(item.request_id)
            if request is None:  # aborted since, or a beam whose group failed earlier in this loop
                continue
            verified = sampled.get(request.request_id) if item.num_draft_tokens else None
            # With drafts, only the KV of the last token and of the accepted drafts is kept.
            request.num_computed_tokens += item.num_tokens if verified is None else len(verified)
            if verified is None:
                self.kv.cache_full_blocks(request)
            if (scored := result.prompt_logprobs.get(request.request_id)) is not None:
                request.add_prompt_logprobs(item.start_position, scored)
            group = self._beam_groups.get(request.request_id)
            if group is not None:
                if request.request_id in failed:
                    updated.extend(self._fail_beam_group(group, failed[request.request_id], now))
                    continue
                candidates = result.beam_candidates.get(request.request_id)
                if candidates is not None:
                    group.pending[request.request_id] = candidates
                    if group.ready:
                        updated.extend(self._advance_beams(group, now))
                continue
            forks = self._start_forks(request, item, now) if item.fork_ids else []
            for sampler in [request, *forks]:  # forks first share the blocks, then anyone may finish
                sid = sampler.request_id
                if sid in failed:
                    sampler.fail(failed[sid], now)
                elif sid in sampled and item.num_draft_tokens:
                    self._take_verified(sampler, item, result)
                elif sid in sampled:
                    [token] = sampled[sid]
                    self._append_token(sampler, token, logprobs[sid][0] if sid in logprobs else None)
                    sampler.spec_token_ids = result.draft_token_ids.get(sid, [])
                elif sid in result.embeddings:
                    sampler.take_embedding(result.embeddings[sid], now)
                else:
                    continue
                updated.append(sampler)
                if sampler.is_finished:
                    self.gate.leave(sid)
                    self.running.remove(sampler)
                    self.kv.free(sid)
                    self.runner_view.finished(sid)
                    del self.requests[sid]
        if self.kv.drops_blocks:  # blocks registered and drafts trimmed: the window's tail can go
            for item in output.scheduled:
                if (live := self.requests.get(item.request_id)) is not None:
                    self.kv.drop_out_of_window(live.request_id, live.num_computed_tokens)
        return updated

    def _take_verified(self, request: Request, item: ScheduledChunk, result: ModelRunnerOutput) -> None:
        """Append what draft verification kept (stopping where the request finishes), register the
        blocks those tokens filled, free the slots of rejected drafts, and take the next drafts."""
        tokens = result.sampled_token_ids[request.request_id]
        logprobs = result.logprobs.get(request.request_id) or [None] * len(tokens)
        self.spec_stats.record(item.num_draft_tokens, len(tokens) - 1)
        for token, logprob in zip(tokens, logprobs, strict=True):
            self._append_token(request, token, logprob)
            if request.is_finished:
                return
        self.kv.cache_full_blocks(request)
        self.kv.trim(request.request_id, request.num_tokens)
        request.spec_token_ids = result.draft_token_ids.get(request.request_id, [])
