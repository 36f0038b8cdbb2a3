"""Two "hosts" on loopback: the head runs the engine and rank 0, a `folio worker` process started on
its own (as it would be on another machine) joins through MASTER_ADDR/MASTER_PORT as rank 1 and gets
the model and its settings from rank 0. Split by tensor, by pipeline (one stage per host, hidden
states crossing the "network") or by context (each host holding every other token's keys, queries
and partial attention crossing), outputs equal the single process's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from folio import LLM
from folio.distributed.rank_auth import SECRET_ENV
from tests.api.server_runner import free_port
from tests.parallel_compare import GREEDY, TINY_PROMPTS, compare
from tests.tiny_models import make_tiny_model


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--pipeline-parallel-size", "--context-parallel-size"])
def test_a_worker_host_joins_through_the_rendezvous(tmp_path, flag, monkeypatch):
    model = make_tiny_model("qwen2", tmp_path / "qwen2")
    port = free_port()
    monkeypatch.setenv(SECRET_ENV, "the-secret-both-hosts-were-given")  # the head reads it from its environment
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    command = [sys.executable, "-m", "folio.cli", "worker", flag, "2", "--nnodes", "2", "--node-rank", "1"]
    worker = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    split = {flag.removeprefix("--").replace("-", "_"): 2}
    try:
        reference = LLM(model, num_kv_blocks=64).generate(TINY_PROMPTS, GREEDY, use_tqdm=False)
        head = LLM(model, num_kv_blocks=64, nnodes=2, master_port=port, **split)
        assert len(head.engine.runner.processes) == 1  # only rank 0 runs on the head host
        got = head.generate(TINY_PROMPTS, GREEDY, use_tqdm=False)
        head.close()
        assert worker.wait(30) == 0  # the head's stop reached the other host's rank
    finally:
        if worker.poll() is None:
            worker.kill()
        stderr = worker.communicate()[1]
    result = compare(reference, got)
    assert result.same_tokens and result.max_logprob_diff < 1e-4, (result, stderr)
