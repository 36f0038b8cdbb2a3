"""Speculative decoding's bookkeeping, with no model: a fake greedy 'model' verifies random drafts
(some right, some wrong), so requests gain several tokens in a step and rejected drafts' slots are
given back. Outputs equal the run without drafts, blocks balance every step, and nothing leaks."""

from __future__ import annotations

import random

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from folio.config import SchedulerConfig
from folio.engine.request import Request
from folio.engine.scheduler import Scheduler
from folio.kv_cache.manager import KVCacheManager
from folio.sampling_params import SamplingParams
from folio.step import ModelRunnerOutput
from tests.step_values import SentTables
from tests.unit.test_scheduler import EOS, fake_next_token, run


def _drafts(rng: random.Random, context: list[int]) -> list[int]:
    """Up to 4 drafts: the fake model's own continuation, wrong from a random position on (or never)."""
    drafts, tokens = [], list(context)
    wrong_from = rng.randint(0, 5)
    for j in range(rng.randint(0, 4)):
        token = fake_next_token(tokens) if j < wrong_from else rng.randint(1, 997)
        drafts.append(token)
        tokens.append(token)
    return drafts


def run_speculating(prompts, max_tokens, num_blocks, block_size, budget, max_seqs, seed):
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=10_000)
    scheduler = Scheduler(config, kv)
    requests = [Request(str(i), p, SamplingParams(max_tokens=m, temperature=0), eos_token_ids=frozenset({EOS}))
                for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]  # fmt: skip
    for r in requests:
        scheduler.add_request(r)
    sent, steps = SentTables(), 0
    while scheduler.has_unfinished:
        steps += 1
        assert steps < 10_000, "no progress"
        out = scheduler.schedule()
        sent.apply(out)
        assert out.num_batched_tokens <= budget
        sampled, proposals = {}, {}
        for item in out.scheduled:
            request = scheduler.requests[item.request_id]
            assert sent.tables_of(item.request_id) == kv.tables_of(item.request_id)
            assert len(sent[item.request_id]) * block_size >= item.start_position + item.num_tokens
            if not item.needs_sample:
                continue
            real = item.token_ids[: item.num_tokens - item.num_draft_tokens]
            context = request.token_ids_between(0, item.start_position) + real
            if item.num_draft_tokens:
                kept = []
                for draft in item.token_ids[item.num_tokens - item.num_draft_tokens :]:
                    if draft != fake_next_token(context):
                        break
                    kept.append(draft)
                    context.append(draft)
                sampled[item.request_id] = [*kept, fake_next_token(context)]
            else:
                sampled[item.request_id] = [fake_next_token(context)]
            context.append(sampled[item.request_id][-1])
            proposals[item.request_id] = _drafts(rng, context)
        scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled, draft_token_ids=proposals))
        owned = [b for tables in kv.block_tables.values() for t in tables for b in t]
        assert len(set(owned)) + kv.pool.num_free_blocks <= num_blocks
        for r in scheduler.running:  # a decoding request holds the blocks of its tokens, no more
            assert all(len(t) <= kv.blocks_needed(r.num_tokens + 4) for t in kv.block_tables.get(r.request_id, []))
    assert kv.pool.num_free_blocks == num_blocks and not kv.block_tables
    return {r.request_id: r.output_token_ids for r in requests}, scheduler


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=30), min_size=1, max_size=5),
    max_tokens=st.integers(1, 25),
    num_blocks=st.integers(16, 40),
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.integers(8, 40),
    seed=st.integers(0, 2**16),
)
def test_random_acceptance_keeps_outputs_and_blocks(prompts, max_tokens, num_blocks, block_size, budget, seed):
    # The engine refuses a request that cannot fit the pool alone (max_model_len is capped to it).
    assume(max(len(p) for p in prompts) + max_tokens <= num_blocks * block_size)
    lengths = [max_tokens] * len(prompts)
    expected, _, _ = run(prompts, lengths, num_blocks, block_size, budget, 4)
    got, scheduler = run_speculating(prompts, lengths, num_blocks, block_size, budget, 4, seed)
    assert got == expected
    stats = scheduler.spec_stats
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
