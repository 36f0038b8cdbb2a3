"""Static and dynamic (request-level) batching against continuous batching, with the fake model:
who may join when, and that every request still gets the tokens it would get alone."""

from __future__ import annotations

import pytest

from folio.config import SchedulerConfig
from folio.engine.batching import BatchGate
from folio.engine.request import Request
from folio.engine.scheduler import Scheduler
from folio.kv_cache.manager import KVCacheManager
from folio.sampling_params import SamplingParams
from folio.step import ModelRunnerOutput
from tests.unit.test_scheduler import EOS, fake_next_token


def _request(i: int, max_tokens: int = 6) -> Request:
    prompt = [(i * 11 + j) % 50 + 1 for j in range(5 + i % 4)]
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                   eos_token_ids=frozenset({EOS}))  # fmt: skip


def _drive(policy: str, arrivals: dict[int, list[Request]], batch_size: int = 3, timeout: float = 0.0,
           flush: bool = False) -> dict[str, tuple[int, int]]:  # fmt: skip
    """(first step, last step) each request ran in."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=1000, batching=policy,
                             batch_size=batch_size, batch_timeout=timeout)  # fmt: skip
    scheduler = Scheduler(config, KVCacheManager(64, 4))
    scheduler.gate.flush = flush
    spans: dict[str, tuple[int, int]] = {}
    step = 0
    while step <= max(arrivals) or scheduler.has_unfinished:
        for request in arrivals.get(step, []):
            scheduler.add_request(request)
        out = scheduler.schedule()
        sampled = {}
        for item in out.scheduled:
            first, _ = spans.get(item.request_id, (step, step))
            spans[item.request_id] = (first, step)
            if item.needs_sample:
                request = scheduler.requests[item.request_id]
                end = item.start_position + item.num_tokens
                sampled[item.request_id] = [fake_next_token(request.token_ids_between(0, end))]
        scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
        step += 1
        if step > 500:
            break
    return spans


def test_static_batches_wait_to_be_full_and_run_to_the_end():
    requests = [_request(i) for i in range(7)]
    spans = _drive("static", {0: requests[:2], 3: requests[2:7]})
    first_batch, second_batch = ["r0", "r1", "r2"], ["r3", "r4", "r5"]
    assert min(spans[r][0] for r in first_batch) == 3  # nothing ran until three requests waited
    assert min(spans[r][0] for r in second_batch) > max(spans[r][1] for r in first_batch)
    assert "r6" not in spans  # a partial batch waits for more requests


def test_static_with_flush_runs_the_partial_batch():
    requests = [_request(i) for i in range(4)]
    spans = _drive("static", {0: requests}, flush=True)
    assert spans["r3"][0] > max(spans[r][1] for r in ("r0", "r1", "r2"))
    assert all(r.is_finished for r in requests)


def test_dynamic_forms_a_batch_on_timeout_and_newcomers_wait_for_the_next():
    requests = [_request(i) for i in range(3)]
    spans = _drive("dynamic", {0: requests[:1], 2: requests[1:]}, timeout=0.0)  # timed out at once
    assert spans["r0"][0] == 0  # alone, after the (zero) timeout
    assert min(spans["r1"][0], spans["r2"][0]) > spans["r0"][1]  # did not join the running batch


def test_continuous_admits_newcomers_at_once_and_outputs_match_every_policy():
    outputs = {}
    for policy in ("continuous", "static", "dynamic"):
        requests = [_request(i, max_tokens=4 + i) for i in range(5)]
        spans = _drive(policy, {0: requests[:2], 2: requests[2:]}, flush=True)
        if policy == "continuous":
            assert spans["r2"][0] == 2
        outputs[policy] = [r.output_token_ids for r in requests]
    assert outputs["continuous"] == outputs["static"] == outputs["dynamic"]


def test_gate_validates_its_settings():
    with pytest.raises(ValueError, match="batching must be one of"):
        BatchGate("greedy", 4, 0.1)
    with pytest.raises(ValueError):
        BatchGate("static", 0, 0.1)
