"""Iteration-level scheduling with one token budget per step.

There are no prefill or decode phases: every request has `num_computed_tokens` and `num_tokens`, and
each step gives running requests their next tokens first (1 for a decode, a chunk for a prompt that is
still being prefilled), then admits waiting requests while budget, sequence slots and KV blocks last.
When a running request needs a block and none is free, the most recently admitted request is
preempted: its blocks are freed and it goes back to the front of the queue to be recomputed.
"""

from __future__ import annotations

import bisect
import itertools
import time

from folio.config import SchedulerConfig
from folio.engine.batching import BatchGate
from folio.engine.request import FinishReason, Request, RequestStatus
from folio.engine.scheduler_output import ForkedSample, ScheduledRequest, SchedulerOutput
from folio.kv_cache.manager import KVCacheManager
from folio.outputs import TokenLogprob


def _queue_order(request: Request) -> tuple[int, int]:
    """Lower priority values first (as vLLM), then arrival."""
    return request.priority, request.arrival_order


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: list[Request] = []  # kept in admission order: (priority, arrival)
        batch_size = min(config.batch_size or config.max_num_seqs, config.max_num_seqs)
        self.gate = BatchGate(config.batching, batch_size, config.batch_timeout)
        self._arrivals = itertools.count()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue management --------------------------------------------------------------------------
    def add_request(self, request: Request, forks: list[Request] | None = None) -> None:
        """Queue a request. `forks` are further samples of the same prompt: they wait until the request
        samples its first token, then share its prompt blocks instead of computing the prompt again."""
        for r in [request, *(forks or [])]:
            if r.request_id in self.requests:
                raise ValueError(f"request id {r.request_id!r} is already in use")
            self.requests[r.request_id] = r
            r.arrival_order = next(self._arrivals)
        request.forks = list(forks or [])
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        # A preempted request keeps its arrival number, so it goes back ahead of later arrivals.
        bisect.insort(self.waiting, request, key=_queue_order)

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        """Drop a request and free its blocks; `reason` is STOP when a stop string ended it."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._release_forks(request)
        for parent in [*self.running, *self.waiting]:
            if request in parent.forks:  # a fork that never started
                parent.forks.remove(request)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request_id)
        self.gate.leave(request_id)
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
        budget = self.config.max_num_batched_tokens
        chosen: list[tuple[Request, int]] = []
        self.running.sort(key=_queue_order)  # budget goes to the most urgent first
        preempted: list[Request] = self._preempt_for_priority(budget)
        made_room = len(preempted)

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            start = request.num_computed_tokens
            while not self.kv.allocate_slots(request.request_id, start + num_new, write_from=start):
                # The least urgent request not yet given tokens this step (maybe this one) makes room.
                victim = max(self.running[index:], key=_queue_order)
                self.running.remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                chosen.append((request, num_new))
                budget -= num_new
                index += 1
                continue
            break  # the request preempted itself: nothing after it can run either

        # Admit waiting requests only when nobody was preempted, so a freed block is not handed
        # straight to a newcomer while the preempted request waits.
        if len(preempted) == made_room:
            self.gate.maybe_form(self.waiting, time.monotonic())
            while budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = next((r for r in self.waiting if self.gate.admits(r)), None)
                if request is None:
                    break
                cached = self.kv.find_cached_prefix(request)
                num_cached = len(cached) * self.kv.block_size
                num_new = min(request.num_tokens - num_cached, budget)
                if not self.kv.allocate_slots(request.request_id, num_cached + num_new, cached):
                    break
                self.kv.record_lookup(request.num_tokens, num_cached)
                request.num_computed_tokens = num_cached
                if request.first_scheduled_time is None:  # the first admission: prompt tokens only
                    request.num_cached_tokens = num_cached
                self.waiting.remove(request)
                request.status = RequestStatus.RUNNING
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = time.monotonic()
                self.running.append(request)
                chosen.append((request, num_new))
                budget -= num_new

        output = SchedulerOutput(preempted_ids=[r.request_id for r in preempted])
        for request, num_new in chosen:
            start = request.num_computed_tokens
            end = start + num_new
            forks = []
            if request.forks and end == request.num_tokens and not request.output_token_ids:
                forks = self._forks_to_sample(request)
            output.scheduled.append(
                ScheduledRequest(
                    request_id=request.request_id,
                    token_ids=request.token_ids_between(start, end),
                    start_position=start,
                    block_table=self.kv.block_table(request.request_id),
                    needs_sample=end == request.num_tokens,
                    sampling_params=request.sampling_params,
                    generator=request.generator,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids,
                    forks=forks,
                )
            )
        output.block_copies = self.kv.take_copies()
        return output

    def _forks_to_sample(self, request: Request) -> list[ForkedSample]:
        """Forks that sample alongside the request's first token; if the running batch has no room for
        them, they become ordinary requests instead (the prefix cache still shares its full blocks)."""
        if len(self.running) + len(request.forks) > self.config.max_num_seqs:
            self._release_forks(request)
            return []
        return [ForkedSample(f.request_id, f.sampling_params, f.generator, f.prompt_token_ids) for f in request.forks]

    def _release_forks(self, request: Request) -> None:
        for fork in request.forks:
            self.gate.join(fork.request_id)
            self._enqueue(fork)
        request.forks = []

    def _start_forks(self, parent: Request, item: ScheduledRequest, now: float) -> list[Request]:
        """Forks sampled this step join the running batch holding the parent's blocks."""
        started = []
        for sample in item.forks:
            fork = self.requests.get(sample.request_id)
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

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)

    def _preempt_for_priority(self, budget: int) -> list[Request]:
        """While the most urgent waiting request outranks a running one and lacks a sequence slot or
        the blocks for its first chunk, preempt the least urgent running request for it."""
        victims: list[Request] = []
        while self.waiting and self.running:
            head, worst = self.waiting[0], self.running[-1]
            if worst.priority <= head.priority:
                break
            chunk = min(head.num_tokens - head.num_computed_tokens, budget)
            has_slot = len(self.running) < self.config.max_num_seqs
            if has_slot and self.kv.blocks_needed(chunk) <= self.kv.pool.num_free_blocks:
                break
            self.running.pop()
            self._preempt(worst)
            victims.append(worst)
        return victims

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, int], logprobs: dict[str, TokenLogprob] | None = None
    ) -> list[Request]:
        """Advance computed counts, append sampled tokens, retire finished requests.

        Returns the requests that produced a token this step (finished ones included).
        """
        updated: list[Request] = []
        now = time.monotonic()
        for item in output.scheduled:
            request = self.requests[item.request_id]
            request.num_computed_tokens += item.num_tokens
            self.kv.cache_full_blocks(request)
            forks = self._start_forks(request, item, now) if item.forks else []
            for sampler in [request, *forks]:  # forks first share the blocks, then anyone may finish
                token = sampled.get(sampler.request_id)
                if token is None:
                    continue
                lp = (logprobs or {}).get(sampler.request_id)
                sampler.append_output_token(token, self.config.max_model_len, lp)
                updated.append(sampler)
                if sampler.is_finished:
                    self.gate.leave(sampler.request_id)
                    self.running.remove(sampler)
                    self.kv.free(sampler.request_id)
                    del self.requests[sampler.request_id]
        return updated
