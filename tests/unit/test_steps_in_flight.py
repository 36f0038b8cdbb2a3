"""The scheduler with several steps in flight (a pipeline's engine submits a step before the previous
one's result is back): a request in flight gets no tokens and is never preempted until its step
returns, aborting one frees its blocks at once, and every request ends with the tokens it gets when
steps run one at a time. Driven by the fake deterministic model of test_scheduler.py."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from folio.config import SchedulerConfig
from folio.engine.request import Request
from folio.engine.scheduler import Scheduler
from folio.kv_cache.manager import KVCacheManager
from folio.sampling_params import SamplingParams
from folio.step import ModelRunnerOutput, SchedulerOutput
from tests.unit.test_scheduler import EOS, fake_next_token
from tests.unit.test_scheduler import run as run_one_at_a_time


def _result(scheduler: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    sampled = {}
    for item in out.scheduled:
        request = scheduler.requests.get(item.request_id)
        if request is not None and item.needs_sample:
            sampled[item.request_id] = [
                fake_next_token(request.token_ids_between(0, item.start_position + item.num_tokens))
            ]
    return ModelRunnerOutput(sampled_token_ids=sampled)


def run_in_flight(
    prompts: list[list[int]], max_tokens: list[int], num_blocks: int, budget: int, depth: int,
    abort_at: dict[int, str] | None = None,
) -> tuple[dict[str, list[int]], Scheduler, int]:  # fmt: skip
    """Up to `depth` steps in flight; `abort_at`: step number -> request id aborted after that step
    was submitted (while it may be in flight)."""
    kv = KVCacheManager(num_blocks, 4)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=10_000)
    scheduler = Scheduler(config, kv)
    requests = [Request(str(i), p, SamplingParams(max_tokens=m, temperature=0), eos_token_ids=frozenset({EOS}))
                for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]  # fmt: skip
    for r in requests:
        scheduler.add_request(r)
    in_flight: deque[SchedulerOutput] = deque()
    steps = most = 0
    while scheduler.has_unfinished or in_flight:
        steps += 1
        assert steps < 10_000, "no progress"
        out = scheduler.schedule()
        flying = {item.request_id for step in in_flight for item in step.scheduled}
        assert not flying & {item.request_id for item in out.scheduled}, "a request in two steps at once"
        assert not flying & set(out.preempted_ids), "a request in flight was preempted"
        started = not out.is_empty
        if started:
            in_flight.append(out)
            most = max(most, len(in_flight))
        if abort_at and steps in abort_at:
            scheduler.abort_request(abort_at[steps])
        owned = [b for tables in kv.block_tables.values() for t in tables for b in t]
        assert len(owned) == len(set(owned)) and len(owned) + kv.pool.num_free_blocks == num_blocks
        if in_flight and (len(in_flight) >= depth or not started):
            oldest = in_flight.popleft()
            scheduler.update_from_output(oldest, _result(scheduler, oldest))
    assert kv.pool.num_free_blocks == num_blocks and not kv.block_tables and not scheduler.in_flight
    return {r.request_id: r.output_token_ids for r in requests}, scheduler, most


def test_two_steps_in_flight_split_the_running_requests():
    prompts = [[5, 6, 7, 8, 9, 10, 11]] * 4
    outputs, _, most = run_in_flight(prompts, [6] * 4, num_blocks=64, budget=16, depth=2)
    assert most == 2
    expected, _, _ = run_one_at_a_time(prompts, [6] * 4, num_blocks=64, block_size=4, budget=16, max_seqs=8)
    assert outputs == expected


def test_an_aborted_request_in_flight_frees_its_blocks_and_its_result_is_dropped():
    prompts = [[3, 4, 5, 6, 7], [8, 9, 10, 11], [12, 13]]
    outputs, scheduler, _ = run_in_flight(prompts, [10, 10, 10], num_blocks=64, budget=8, depth=2, abort_at={3: "1"})
    assert scheduler.requests == {}
    assert len(outputs["1"]) < 10 and len(outputs["0"]) == 10 and len(outputs["2"]) == 10


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=6),
    max_tokens=st.integers(1, 12),
    num_blocks=st.integers(12, 40),
    budget=st.integers(4, 24),
    depth=st.integers(2, 4),
)
def test_any_depth_gives_the_one_at_a_time_tokens(lengths, max_tokens, num_blocks, budget, depth):
    # Tight pools preempt (requests not in flight only) and recompute: tokens stay those of a run with
    # one step at a time.
    prompts = [[(7 * i + j) % 50 + 1 for j in range(n)] for i, n in enumerate(lengths)]
    got, _, _ = run_in_flight(prompts, [max_tokens] * len(prompts), num_blocks, budget, depth)
    expected, _, _ = run_one_at_a_time(prompts, [max_tokens] * len(prompts), num_blocks, 4, budget, 8)
    assert got == expected
