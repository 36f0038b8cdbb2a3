"""A split model's ranks meet at a rendezvous anyone on the network can reach. A party without the rank
secret that answers there first (a fake head for a worker, a fake last stage for a head) ends the meeting
at the challenge and runs no code anywhere; the ranks' messages are typed, never unpickled."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import threading
from datetime import timedelta

import msgspec
import pytest
import torch.distributed as dist

from folio import LLM
from folio.distributed import rank_auth, wire
from folio.distributed.rendezvous import _listening_socket
from folio.worker.executor import WorkerDiedError
from folio.worker.step_relay import RankMessage, RankResult
from tests.api.server_runner import free_port
from tests.distributed.fake_rank import Payload
from tests.tiny_models import make_tiny_model

SECRET = "a-test-rank-secret"


def _fake(role: str, port: int, marker) -> subprocess.Popen:
    command = [sys.executable, "-m", "tests.distributed.fake_rank", role, str(port), str(marker)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(10)


def test_a_fake_head_runs_no_code_on_a_worker(tmp_path):
    marker = tmp_path / "ran"
    port = free_port()
    fake = _fake("master", port, marker)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), rank_auth.SECRET_ENV: SECRET}
    command = [sys.executable, "-m", "folio.cli", "worker", "-tp", "2", "--nnodes", "2", "--node-rank", "1"]
    worker = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = worker.communicate(timeout=240)
    finally:
        _stop(worker)
        _stop(fake)
    assert worker.returncode != 0 and "rank secret" in stderr, stderr[-2000:]
    assert not marker.exists()


def test_a_fake_last_stage_runs_no_code_on_the_head(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    model = make_tiny_model("qwen2", tmp_path / "qwen2")
    port = free_port()
    monkeypatch.setenv(rank_auth.SECRET_ENV, SECRET)
    fake = _fake("last_stage", port, marker)
    try:
        with pytest.raises(WorkerDiedError, match="rank secret"):
            LLM(model, num_kv_blocks=16, nnodes=2, master_port=port, pipeline_parallel_size=2)
    finally:
        _stop(fake)
    assert not marker.exists()


def test_a_worker_without_the_secret_is_refused_before_it_starts(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != rank_auth.SECRET_ENV}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    command = [sys.executable, "-m", "folio.cli", "worker", "-tp", "2", "--nnodes", "2", "--node-rank", "1"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and rank_auth.SECRET_ENV in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1  # one line, no traceback


def _meet(secrets: list[str]) -> list[BaseException | None]:
    """Every rank runs the challenge on one store (threads stand in for hosts); what each raised."""
    port = free_port()
    stores = [dist.TCPStore("127.0.0.1", port, len(secrets), True, timedelta(seconds=20), wait_for_workers=False,
                            master_listen_fd=_listening_socket("127.0.0.1", port))]  # fmt: skip
    stores += [dist.TCPStore("127.0.0.1", port, len(secrets), False, timedelta(seconds=20)) for _ in secrets[1:]]
    raised: list[BaseException | None] = [None] * len(secrets)

    def run(rank: int) -> None:
        try:
            rank_auth.authenticate(stores[rank], rank, len(secrets), secrets[rank])
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            raised[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(secrets))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return raised


def test_ranks_with_the_secret_meet_and_one_without_it_is_named():
    assert _meet([SECRET] * 3) == [None, None, None]
    raised = _meet([SECRET, SECRET, "wrong"])
    assert all(isinstance(exc, rank_auth.RankAuthError) for exc in raised)
    assert "rank 2" in str(raised[0]) and "rank 2" in str(raised[1]) and "rank 0" in str(raised[2])


def test_the_rendezvous_listens_on_its_own_address_alone():
    port = free_port()
    with socket.socket(fileno=_listening_socket("127.0.0.1", port)) as listener:
        assert listener.getsockname() == ("127.0.0.1", port)


def test_a_pickle_on_the_wire_is_refused_unrun(tmp_path):
    marker = tmp_path / "ran"
    for kind in (RankMessage, RankResult):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            wire.decoder(kind).decode(pickle.dumps(Payload(str(marker))))
        with pytest.raises(msgspec.ValidationError):
            wire.decoder(kind).decode(wire.encode({"kind": "step", "step": {"new_requests": "x"}, "output": 1}))
    with pytest.raises(msgspec.ValidationError):  # a tensor of a dtype that does not cross
        wire.decoder(RankResult).decode(wire.encode({"output": {"embeddings": {"a": ["object", [1], b"x"]}}}))
    assert not marker.exists()
