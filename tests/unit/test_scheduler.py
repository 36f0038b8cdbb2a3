"""The scheduler driven by a fake deterministic model: no tensors, only bookkeeping."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from folio.config import SchedulerConfig
from folio.engine.request import FinishReason, Request
from folio.engine.scheduler import Scheduler
from folio.kv_cache.manager import KVCacheManager
from folio.sampling_params import SamplingParams
from folio.step import ModelRunnerOutput
from tests.step_values import SentTables

EOS = 0


def fake_next_token(tokens: list[int]) -> int:
    """A deterministic 'greedy model': the next token depends on the whole sequence."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) * 7919 + len(tokens)) % 997 + 1


def run(
    prompts: list[list[int]], max_tokens: list[int], num_blocks: int, block_size: int, budget: int, max_seqs: int
) -> tuple[dict[str, list[int]], Scheduler, int]:
    kv = KVCacheManager(num_blocks, block_size)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=10_000)
    scheduler = Scheduler(config, kv)
    requests = [
        Request(str(i), p, SamplingParams(max_tokens=m, temperature=0), eos_token_ids=frozenset({EOS}))
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
    ]
    for r in requests:
        scheduler.add_request(r)
    steps = 0
    sent = SentTables()
    while scheduler.has_unfinished:
        steps += 1
        assert steps < 10_000, "scheduler made no progress"
        out = scheduler.schedule()
        sent.apply(out)
        assert not out.is_empty, "nothing scheduled while requests wait: deadlock"
        assert out.num_batched_tokens <= budget
        assert len(scheduler.running) <= max_seqs
        owned = [b for tables in kv.block_tables.values() for t in tables for b in t]
        assert len(owned) == len(set(owned)) and len(owned) + kv.pool.num_free_blocks == num_blocks
        sampled = {}
        for item in out.scheduled:
            request = scheduler.requests[item.request_id]
            assert item.start_position == request.num_computed_tokens
            end = item.start_position + item.num_tokens
            assert len(sent[item.request_id]) * block_size >= end  # KV room for every scheduled token
            assert sent.tables_of(item.request_id) == kv.tables_of(item.request_id)  # the deltas rebuild the table
            if item.needs_sample:
                sampled[item.request_id] = [fake_next_token(request.token_ids_between(0, end))]
        scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
    assert kv.pool.num_free_blocks == num_blocks and not kv.block_tables
    return {r.request_id: r.output_token_ids for r in requests}, scheduler, steps


def test_decode_and_prefill_share_a_step():
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=4, max_model_len=1000), kv)
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=5)))
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": [9]}))
    scheduler.add_request(Request("b", list(range(1, 30)), SamplingParams(max_tokens=5)))
    out = scheduler.schedule()
    by_id = {s.request_id: s for s in out.scheduled}
    assert by_id["a"].num_tokens == 1 and by_id["a"].needs_sample  # the decode goes first
    assert by_id["b"].num_tokens == 9 and not by_id["b"].needs_sample  # a chunk of the long prompt


def test_finish_reasons():
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=4, max_model_len=1000), kv)
    stop = Request("stop", [1, 2], SamplingParams(max_tokens=10, stop_token_ids=[42]))
    length = Request("length", [1, 2], SamplingParams(max_tokens=2))
    eos = Request("eos", [1, 2], SamplingParams(max_tokens=10), eos_token_ids=frozenset({7}))
    ignored = Request("ignored", [1, 2], SamplingParams(max_tokens=2, ignore_eos=True), eos_token_ids=frozenset({7}))
    for r in (stop, length, eos, ignored):
        scheduler.add_request(r)
    for tokens in ({"stop": [42], "length": [5], "eos": [7], "ignored": [7]}, {"length": [5], "ignored": [7]}):
        scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput(sampled_token_ids=tokens))
    assert (stop.finish_reason, length.finish_reason) == (FinishReason.STOP, FinishReason.LENGTH)
    assert (eos.finish_reason, ignored.finish_reason) == (FinishReason.STOP, FinishReason.LENGTH)
    assert ignored.output_token_ids == [7, 7] and kv.pool.num_free_blocks == 64


def test_context_length_ends_a_request():
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=4, max_model_len=6), kv)
    request = Request("r", [1, 2, 3, 4], SamplingParams(max_tokens=100))
    scheduler.add_request(request)
    while scheduler.has_unfinished:
        scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput(sampled_token_ids={"r": [5]}))
    assert request.num_tokens == 6 and request.finish_reason == FinishReason.LENGTH


def test_abort_returns_blocks():
    kv = KVCacheManager(16, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=4, max_model_len=1000), kv)
    scheduler.add_request(Request("a", list(range(1, 20)), SamplingParams(max_tokens=5)))
    scheduler.add_request(Request("b", list(range(1, 5)), SamplingParams(max_tokens=5)))
    scheduler.schedule()
    assert kv.pool.num_free_blocks < 16
    assert scheduler.abort_request("a").finish_reason == FinishReason.ABORT
    assert scheduler.abort_request("b") is not None
    assert kv.pool.num_free_blocks == 16 and not scheduler.has_unfinished


def test_tiny_pool_preempts_and_matches_unconstrained_run():
    prompts = [[(i * 13 + j) % 50 + 1 for j in range(10 + 7 * i)] for i in range(6)]
    max_tokens = [30, 12, 25, 40, 8, 33]
    reference, _, _ = run(prompts, max_tokens, num_blocks=1000, block_size=4, budget=512, max_seqs=16)
    constrained, scheduler, _ = run(prompts, max_tokens, num_blocks=20, block_size=4, budget=16, max_seqs=16)
    assert scheduler.num_preemptions > 0
    assert constrained == reference


def test_make_stats_is_a_reading_that_stays_as_read():
    kv = KVCacheManager(16, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=1, max_model_len=1000), kv)
    scheduler.add_request(Request("a", list(range(1, 20)), SamplingParams(max_tokens=5)))
    scheduler.add_request(Request("b", list(range(1, 5)), SamplingParams(max_tokens=5)))
    empty = scheduler.make_stats()
    assert (empty.num_running, empty.num_waiting, empty.kv_usage_ratio, empty.kv_capacity_tokens) == (0, 2, 0.0, 64)
    scheduler.schedule()
    scheduler.spec_stats.record(3, 2)
    stats = scheduler.make_stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert stats.kv_usage_ratio == 1 - kv.pool.num_free_blocks / 16 > 0
    assert stats.spec_decoding.accepted_per_position == [1, 1, 0]
    scheduler.spec_stats.record(3, 3)  # the engine steps on; the reading does not change under its reader
    assert stats.spec_decoding.num_drafts == 1 and stats.spec_decoding.accepted_per_position == [1, 1, 0]
    assert empty.spec_decoding.num_drafts == 0


@settings(max_examples=60, deadline=None)
@given(
    prompt_lens=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    max_tokens=st.lists(st.integers(1, 30), min_size=8, max_size=8),
    block_size=st.sampled_from([1, 2, 4, 16]),
    budget=st.integers(1, 64),
    max_seqs=st.integers(1, 8),
    extra_blocks=st.integers(0, 30),
)
def test_every_request_finishes_with_the_unconstrained_output(
    prompt_lens, max_tokens, block_size, budget, max_seqs, extra_blocks
):
    prompts = [[(i * 31 + j * 7) % 90 + 1 for j in range(n)] for i, n in enumerate(prompt_lens)]
    max_tokens = max_tokens[: len(prompts)]
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens, strict=True))
    # The smallest legal pool holds the longest request alone.
    num_blocks = -(-longest // block_size) + extra_blocks
    reference, _, _ = run(prompts, max_tokens, 10_000, block_size, 4096, 64)
    outputs, _, _ = run(prompts, max_tokens, num_blocks, block_size, budget, max_seqs)
    assert outputs == reference
