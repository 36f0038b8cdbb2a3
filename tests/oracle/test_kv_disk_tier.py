"""`--kv-cache-dir`: every computed prefix-cache block is also a file, read back after memory pressure or a
restart. Outputs (greedy tokens and logprobs) equal those of a pool that never evicts, for every KV
format, chunked and under preemption; a waiting read never stalls the batch; a directory that cannot be
written, a full disk or a directory removed while serving cost hits, never a request; two processes
share one directory."""

from __future__ import annotations

import errno
import json
import logging
import shutil
import subprocess
import sys
import threading

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from folio import LLM
from folio.engine.request import Request
from folio.server.metrics import ServerMetrics
from folio.worker import disk_tier_store
from tests.oracle.test_kv_host_tier import BLOCK, FIRST, GREEDY, SECOND, _outputs, _same, _tokens
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("disk-tier"))


def _one_by_one(llm: LLM, prompts: list[list[int]]) -> list:
    return [llm.generate([prompt], GREEDY, use_tqdm=False)[0] for prompt in prompts]


def _first_round_written(model, directory, **settings) -> None:
    writer = LLM(model, num_kv_blocks=16, kv_cache_dir=directory, **settings)
    _one_by_one(writer, FIRST)
    writer.close()  # its I/O thread finishes the writes


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("schedule", ["whole", "chunked", "preempting"])
def test_a_restarted_engine_reads_prefixes_from_disk_and_outputs_equal(tiny_llama, tmp_path, kv_cache_dtype,
                                                                        schedule):  # fmt: skip
    settings = {"block_size": BLOCK, "kv_cache_dtype": kv_cache_dtype}
    if schedule == "chunked":
        settings["max_num_batched_tokens"] = 7
    _first_round_written(tiny_llama, tmp_path, **settings)
    # A RAM tier that stages every session's prefix at once: under preemption each request finds all
    # of its prefix, as in the roomy pool (an 8-bit KV computed at other chunk bounds rounds otherwise).
    reader = LLM(tiny_llama, num_kv_blocks=16, kv_offload_ram="1MiB", kv_cache_dir=tmp_path, **settings)
    together = schedule == "preempting"
    ours = reader.generate(SECOND, GREEDY, use_tqdm=False) if together else _one_by_one(reader, SECOND)
    roomy = _outputs(LLM(tiny_llama, num_kv_blocks=64, **settings), together)[3:]
    disk = reader.engine.kv.disk
    assert disk is not None and disk.num_loaded == 18 and disk.num_failed == 0
    if together:
        assert reader.engine.make_stats().num_preemptions > 0
        _same(ours, roomy, 1e-4 if kv_cache_dtype == "auto" else 0.1)  # see test_kv_host_tier
    else:
        assert [o.metrics.num_cached_tokens for o in ours] == [24, 24, 24]
        _same(ours, roomy, 1e-6)  # the blocks came back bit for bit
    pool = reader.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def test_with_both_tiers_evicted_blocks_come_back_through_ram_and_disk(tiny_llama, tmp_path):
    # A RAM tier of 2 blocks grows to stage the disk's reads: 10 blocks, the longest request's.
    llm = LLM(tiny_llama, num_kv_blocks=16, block_size=BLOCK, max_model_len=40, kv_offload_ram=6144,
              kv_cache_dir=tmp_path)  # fmt: skip
    assert llm.engine.kv.tier is not None and llm.engine.kv.tier.num_slots == 10
    ours = _outputs(llm)
    _same(ours, _outputs(LLM(tiny_llama, num_kv_blocks=64, block_size=BLOCK)), 1e-6)
    assert [o.metrics.num_cached_tokens for o in ours[3:]] == [24, 24, 24]
    assert llm.engine.kv.disk is not None and llm.engine.kv.disk.num_loaded > 0


def test_a_read_in_flight_holds_back_only_its_own_request(tiny_llama, tmp_path):
    _first_round_written(tiny_llama, tmp_path, block_size=BLOCK)
    llm = LLM(tiny_llama, num_kv_blocks=16, block_size=BLOCK, kv_cache_dir=tmp_path)
    engine, store = llm.engine, llm.engine.runner.disk_tier
    gate = threading.Event()
    read = store._load
    store._load = lambda op: (gate.wait(30), read(op))  # the disk is slow today
    engine.add_request(Request("from-disk", SECOND[0], GREEDY))
    engine.add_request(Request("fresh", _tokens(99, 9), GREEDY))
    engine.step()
    assert engine.last_step.num_batched_tokens == 9  # the fresh prompt ran; the other waits for its blocks
    assert [r.request_id for r in engine.scheduler.waiting] == ["from-disk"] and not engine.stalled
    gate.set()
    finished = {}
    while engine.has_unfinished():
        finished.update({r.request_id: r for r in engine.step() if r.is_finished})
    assert finished["from-disk"].num_cached_tokens == 24


def test_a_directory_that_cannot_be_written_leaves_no_disk_tier(tiny_llama, caplog):
    with caplog.at_level(logging.WARNING, logger="folio"):
        llm = LLM(tiny_llama, num_kv_blocks=16, block_size=BLOCK, kv_cache_dir="/proc/folio-kv-cache")
    assert llm.engine.kv.disk is None and "KV disk tier off" in caplog.text
    _same(_outputs(llm), _outputs(LLM(tiny_llama, num_kv_blocks=16, block_size=BLOCK)), 1e-6)


def test_a_full_disk_costs_hits_not_requests(tiny_llama, tmp_path, monkeypatch, caplog):
    def full(*_args) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier_store, "write_file", full)
    llm = LLM(tiny_llama, num_kv_blocks=16, block_size=BLOCK, kv_offload_ram="1MiB", kv_cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="folio"):
        ours = _outputs(llm)
    _same(ours, _outputs(LLM(tiny_llama, num_kv_blocks=64, block_size=BLOCK)), 1e-6)  # the RAM tier served
    assert caplog.text.count("KV disk tier off") == 1
    reading = llm.engine.make_stats().disk
    assert reading is not None and not reading.enabled and reading.files == 0
    assert not any(tmp_path.rglob("*.kv")) and not any(tmp_path.rglob(".*.tmp"))


def test_a_directory_removed_while_serving_costs_hits_not_requests(tiny_llama, tmp_path):
    llm = LLM(tiny_llama, num_kv_blocks=16, block_size=BLOCK, max_model_len=40, kv_cache_dir=tmp_path)
    first = _one_by_one(llm, FIRST)
    llm.engine.runner.disk_tier.drain()
    shutil.rmtree(tmp_path)
    second = _one_by_one(llm, SECOND)
    plain = LLM(tiny_llama, num_kv_blocks=16, block_size=BLOCK, enable_prefix_caching=False)
    _same(first + second, _one_by_one(plain, FIRST + SECOND), 1e-4)
    disk = llm.engine.kv.disk
    assert disk is not None and disk.num_failed > 0 and disk.enabled
    llm.engine.runner.disk_tier.drain()
    assert any(tmp_path.rglob("*.kv"))  # made again, and written to


def test_a_restarted_server_answers_a_known_prompt_from_disk(tiny_llama, tmp_path):
    """The server's engine thread sleeps while nothing can run: a request waiting for its blocks from disk
    must wake it when they arrive, not wait for the next request."""
    from openai import OpenAI

    from tests.api.server_runner import running_server

    prompt = " ".join(f"t{10 + (7 * i) % 300}" for i in range(200))
    answers = []
    for _ in range(2):  # the second server is the first restarted, on the same directory
        with running_server(LLM(tiny_llama, kv_cache_dir=tmp_path), "tiny") as (url, _):
            client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=30, max_retries=0)
            answers.append(client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0))
    assert answers[1].choices[0].text == answers[0].choices[0].text
    assert answers[0].usage.prompt_tokens_details.cached_tokens == 0
    assert answers[1].usage.prompt_tokens_details.cached_tokens >= 192  # every whole block but the last


WRITER = """
import json, sys
from folio import LLM
from tests.oracle.test_kv_host_tier import GREEDY, _tokens
model, directory, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = LLM(model, num_kv_blocks=16, block_size=4, kv_cache_dir=directory)
shared = [_tokens(10 + i, 24) + _tokens(seed, 3) for i in range(3)]  # both processes write these blocks
own = [_tokens(seed + i, 24) for i in range(3)]
outputs = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in shared + own]
llm.close()
print(json.dumps(outputs))
"""


def test_two_processes_share_one_directory(tiny_llama, tmp_path):
    runs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tiny_llama), str(tmp_path), str(seed)],
                             stdout=subprocess.PIPE, text=True) for seed in (50, 60)]  # fmt: skip
    written = [json.loads(run.communicate(timeout=300)[0]) for run in runs]
    assert all(run.returncode == 0 for run in runs)
    reader = LLM(tiny_llama, num_kv_blocks=16, block_size=BLOCK, kv_cache_dir=tmp_path)
    disk = reader.engine.kv.disk
    assert disk is not None and disk.num_files == len(list(tmp_path.rglob("*.kv")))
    own = [_tokens(seed + i, 24) for seed in (50, 60) for i in range(3)]
    ours = _one_by_one(reader, SECOND + own)
    assert [o.metrics.num_cached_tokens for o in ours] == [24] * 3 + [20] * 6
    assert disk.num_failed == 0 and reader.engine.runner.disk_tier.counters.refused_files == 0
    assert [o.outputs[0].token_ids for o in ours[3:6]] == written[0][3:] and written[1][3:] == [
        o.outputs[0].token_ids for o in ours[6:]
    ]
    _same(ours[:3], _one_by_one(LLM(tiny_llama, num_kv_blocks=64, block_size=BLOCK), SECOND), 1e-4)


def test_metrics_count_the_disk_tiers_blocks_bytes_and_seconds(tiny_llama, tmp_path):
    _first_round_written(tiny_llama, tmp_path, block_size=BLOCK)
    llm = LLM(tiny_llama, num_kv_blocks=16, block_size=BLOCK, kv_cache_dir=tmp_path)
    _one_by_one(llm, SECOND)
    metrics = ServerMetrics(llm.engine, "tiny")
    metrics.on_step([], 0.0)
    samples = {s.name: s.value for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
               for s in f.samples}  # fmt: skip
    disk = llm.engine.kv.disk
    assert disk is not None and samples["folio:kv_cache_disk_loaded_blocks_total"] == disk.num_loaded >= 18
    assert samples["folio:kv_cache_disk_stored_blocks_total"] == disk.num_stored > 0
    assert samples["folio:kv_cache_disk_read_bytes_total"] > 0 and samples["folio:kv_cache_disk_load_seconds_total"] > 0
    assert samples["folio:kv_cache_disk_failed_loads_total"] == 0 and samples["folio:kv_cache_disk_enabled"] == 1
    assert 0 < samples["folio:kv_cache_disk_usage_ratio"] < 1
