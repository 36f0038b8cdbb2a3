"""A rank that dies ends the engine cleanly: the caller gets an error at once (no hang), the other
ranks are stopped, and nothing is left running; a server answers 503 and exits non-zero."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from folio import LLM, SamplingParams
from folio.worker.executor import WorkerDiedError
from tests.api.server_runner import free_port
from tests.tiny_models import make_tiny_chat_model


def _gone(processes: list[psutil.Process], timeout: float) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return not alive


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tp-chat") / "llama")


@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                                   {"context_parallel_size": 2}], ids=["tp2", "pp2", "cp2"])  # fmt: skip
def test_a_rank_killed_mid_run_fails_the_call_and_leaves_no_process(chat_model, split):
    # Under a pipeline, rank 1 is the last stage: rank 0 waits on its hidden states' receiver.
    llm = LLM(chat_model, num_kv_blocks=64, **split)
    ranks = list(llm.engine.runner.processes)
    rank_processes = [psutil.Process(p.pid) for p in ranks]
    stream = llm.stream([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True, temperature=0))
    next(stream)
    os.kill(ranks[1].pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank"):
        for _ in stream:
            pass
    assert time.monotonic() - started < 30
    assert _gone(rank_processes, timeout=15)
    with pytest.raises(WorkerDiedError):  # the engine stays dead; it does not hang on a later call
        llm.generate([[4, 5]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_a_served_split_model_answers_503_and_exits_non_zero_when_a_rank_dies(chat_model):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "folio.cli", "serve", str(chat_model), "--port", str(port),
                                "--num-kv-blocks", "64", "--tensor-parallel-size", "2"],
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        body = {"model": str(chat_model), "prompt": "t1 t2", "max_tokens": 3}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        ranks = [p for p in psutil.Process(process.pid).children(recursive=True) if p.pid != process.pid]
        assert len(ranks) >= 2
        os.kill(ranks[-1].pid, signal.SIGKILL)
        body["max_tokens"] = 50
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert answer.status_code == 503, answer.text
        assert process.wait(30) == 1
        assert _gone(ranks, timeout=15)
    finally:
        if process.poll() is None:
            process.kill()
        stderr = process.communicate()[1]
    assert "a rank of the split model failed" in stderr, stderr


def test_ranks_read_the_environment_as_it_is_when_they_start(chat_model, monkeypatch):
    """Ranks fork from multiprocessing's fork server, which keeps the environment of the first split model's
    start; each rank still runs with the engine's environment of its own start (here a bad kernel switch,
    which only a rank reads: it fails there, and the engine says so)."""
    LLM(chat_model, num_kv_blocks=64, tensor_parallel_size=2).close()  # the fork server runs from here on
    monkeypatch.setenv("FOLIO_KERNELS", "bogus")
    # The same model and flags just started; now every rank fails on the switch, and whichever the engine
    # hears of first (rank 0's error, or another rank's exit) is the error.
    with pytest.raises(WorkerDiedError, match="FOLIO_KERNELS='bogus'|a rank of the split model failed"):
        LLM(chat_model, num_kv_blocks=64, tensor_parallel_size=2)
