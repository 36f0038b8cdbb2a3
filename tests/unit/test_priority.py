"""Priority scheduling with the fake deterministic model: under overload, urgent requests get their
first token within a few steps of arriving while the others wait, and every request still finishes
with the output it would have had alone."""

from __future__ import annotations

from folio.config import SchedulerConfig
from folio.engine.request import Request
from folio.engine.scheduler import Scheduler
from folio.kv_cache.manager import KVCacheManager
from folio.sampling_params import SamplingParams
from folio.step import ModelRunnerOutput
from tests.unit.test_scheduler import EOS, fake_next_token


def _drive(arrivals: dict[int, list[Request]], num_blocks: int, max_seqs: int) -> tuple[dict[str, int], int]:
    """Run until done; requests in arrivals[s] are added before step s. Returns each request's first-token step."""
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=max_seqs, max_model_len=1000), kv)
    first_token: dict[str, int] = {}
    step = 0
    while step <= max(arrivals) or scheduler.has_unfinished:
        for request in arrivals.get(step, []):
            scheduler.add_request(request)
        out = scheduler.schedule()
        sampled = {}
        for item in out.scheduled:
            request = scheduler.requests[item.request_id]
            end = item.start_position + item.num_tokens
            if item.needs_sample:
                sampled[item.request_id] = [fake_next_token(request.token_ids_between(0, end))]
                first_token.setdefault(item.request_id, step)
        scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
        step += 1
        assert step < 5000
    assert kv.pool.num_free_blocks == num_blocks
    return first_token, step


def _request(rid: str, priority: int, length: int = 12, max_tokens: int = 40) -> Request:
    prompt = [(sum(map(ord, rid)) * 7 + i) % 50 + 1 for i in range(length)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Request(rid, prompt, params, eos_token_ids=frozenset({EOS}), priority=priority)


def test_urgent_requests_keep_their_ttft_under_overload():
    background = [_request(f"low{i}", priority=10) for i in range(8)]
    urgent = [_request(f"high{i}", priority=0, max_tokens=5) for i in range(3)]
    arrivals = {0: background, 5: urgent[:1], 9: urgent[1:2], 13: urgent[2:]}
    first_token, _ = _drive(arrivals, num_blocks=40, max_seqs=2)  # two slots, all taken by background work
    for i, step in zip(range(3), (5, 9, 13), strict=True):
        assert first_token[f"high{i}"] - step <= 1  # admitted at once, preempting a background request
    assert max(first_token[f"low{i}"] for i in range(8)) > 60  # the background waits its turn
    # Nothing is lost or changed: each request's tokens equal a run on an idle engine.
    for request in background + urgent:
        alone = _request(request.request_id, request.priority, max_tokens=request.sampling_params.max_tokens)
        _drive({0: [alone]}, num_blocks=40, max_seqs=2)
        assert request.output_token_ids == alone.output_token_ids and request.is_finished


def test_equal_priorities_stay_first_come_first_served():
    requests = [_request(f"r{i}", priority=1) for i in range(5)]
    first_token, _ = _drive({0: requests}, num_blocks=40, max_seqs=1)
    assert [first_token[f"r{i}"] for i in range(5)] == sorted(first_token.values())


def test_blocks_running_out_preempt_the_least_urgent_first():
    """A pool too small for all: the urgent request is never the one preempted."""
    requests = [_request("urgent", 0, length=20, max_tokens=30)] + [_request(f"bg{i}", 5, length=20) for i in range(3)]
    _drive({0: requests}, num_blocks=24, max_seqs=4)
    assert requests[0].num_preemptions == 0 and sum(r.num_preemptions for r in requests[1:]) > 0
