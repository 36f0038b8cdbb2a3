"""A `folio serve --replicas ...` process on a local Ray instance, what its /metrics say, and Ray's own
test cluster for the servers that join one, for the Ray tests (tests/api/test_ray_replicas.py)."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import psutil
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray.cluster_utils import Cluster

from tests.api.server_runner import MODEL, free_port

KEY = "ray-test-key"


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)  # gRPC's IPv6 socket bound to ::ffff:127.0.0.1
    return (mapped or address).is_loopback


def bound_sockets(root: psutil.Process) -> dict[str, list[str]]:
    """'name pid' -> 'ip:port' of every listening TCP socket and bound UDP socket of `root` and the
    processes under it (a server that started Ray: the GCS, the raylet, and the workers under it)."""
    found: dict[str, list[str]] = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            name = process.name()
            sockets = process.net_connections(kind="inet")
        except psutil.NoSuchProcess:  # a worker that just exited
            continue
        for sock in sockets:
            if sock.status == psutil.CONN_LISTEN or (sock.status == psutil.CONN_NONE and sock.laddr):
                found.setdefault(f"{name} {process.pid}", []).append(f"{sock.laddr.ip}:{sock.laddr.port}")
    return found


class RayServer:
    def __init__(
        self, *replica_flags: str, model: str = MODEL, cpus: int = 1, environment: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="folio-ray-", suffix=".log")  # noqa: SIM115
        command = [sys.executable, "-m", "folio.cli", "serve", model, *(replica_flags or ("--replicas", "2")),
                   "--cpus-per-replica", str(cpus), "--port", str(self.port), "--num-kv-blocks", "256",
                   "--max-num-seqs", "8", "--api-key", KEY]  # fmt: skip
        env = {**os.environ, **(environment or {})}
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float, replicas: int = 2, role: str = "engine") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"folio serve --replicas exited:\n{self.output()[-4000:]}"
            if len(self.replicas(role)) == replicas:
                return
            time.sleep(0.5)
        raise AssertionError(f"the replicas did not come up:\n{self.output()[-4000:]}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def metrics(self) -> str:
        response = httpx.get(f"{self.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        response.raise_for_status()  # before the app is up, Serve's proxy answers 404 in its own words
        return response.text

    def samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        families = text_string_to_metric_families(self.metrics())
        return [(s.labels, s.value) for family in families for s in family.samples if s.name == name]

    def replicas(self, role: str = "engine") -> dict[str, int]:
        """replica id -> pid, of the replicas of `role` whose engine runs."""
        try:
            info = self.samples("folio:replica_info")
        except httpx.HTTPError:  # not serving yet (no connection, or the proxy's 404)
            return {}
        return {labels["replica"]: int(labels["pid"]) for labels, up in info if up == 1.0 and labels["role"] == role}

    def routed(self) -> Counter:
        """(replica, reason) -> prompts the router sent there."""
        counts: Counter = Counter()
        for labels, value in self.samples("folio:router_requests_total"):
            counts[(labels["replica"], labels["reason"])] = int(value)
        return counts

    def per_replica(self, name: str) -> dict[str, float]:
        return {labels["replica"]: value for labels, value in self.samples(name)}


def stop_ray_server(server: RayServer) -> None:
    if server.process.poll() is None:  # a test failed before it was stopped
        server.process.terminate()
        try:
            server.process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout=30)
    server.log.close()


def shutdown_serve() -> None:
    """A server leaves a joined cluster's Serve running (other applications may use it), and with it the
    HTTP port it was given: stopped after each server, so that the next one starts Serve on its own port."""
    with warnings.catch_warnings():  # Serve's own pydantic deprecations, on import
        warnings.simplefilter("ignore")
        from ray import serve
    serve.shutdown()


def routed_delta(before: Counter, after: Counter) -> dict[str, int]:
    delta: Counter = Counter()
    for (replica, _), value in after.items():
        delta[replica] += value - before.get((replica, _), 0)
    return {replica: count for replica, count in delta.items() if count}


def sigterm_and_check_gone(server: RayServer, pids: list[int]) -> None:
    """SIGTERM the server: it exits 0 and none of `pids` (a split replica's ranks) outlives it."""
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=90) == 0
    deadline = time.monotonic() + 30
    while any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids):
        assert time.monotonic() < deadline, "a rank outlived its replica"
        time.sleep(0.5)


class StreamOnThread(threading.Thread):
    """One streamed greedy completion (EOS ignored) on a thread of its own: its chunks as they come, and
    the API error that ended it, if one did. `started` is set at the first chunk, or at the end."""

    def __init__(self, client: openai.OpenAI, prompt: str, max_tokens: int) -> None:
        super().__init__()
        self.client, self.prompt, self.max_tokens = client, prompt, max_tokens
        self.started = threading.Event()
        self.chunks: list = []
        self.failure: list[openai.APIError] = []

    def run(self) -> None:
        try:
            stream = self.client.completions.create(
                model=MODEL, prompt=self.prompt, max_tokens=self.max_tokens, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            for chunk in stream:
                self.chunks.append(chunk)
                self.started.set()
        except openai.APIError as exc:
            self.failure.append(exc)
        finally:
            self.started.set()


def completion_texts(client: openai.OpenAI, ask: dict) -> list[str]:
    return [choice.text for choice in client.completions.create(**ask).choices]


def wait_for_metric(server: RayServer, condition, timeout: float = 15) -> None:
    """Replicas post their metrics every second: poll until `condition` holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, server.metrics()[-3000:]
        time.sleep(0.5)


@contextmanager
def ray_test_cluster() -> Iterator[Cluster]:
    """Ray's own test cluster (raylets on this machine). Its head node has 3 CPUs: a 2-rank replica packs
    there, and a prefill replica beside two decode ones fits. This process joins it too, to stop Serve
    between servers."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": False})
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(address=cluster.address, log_to_driver=False)  # which sets its own SIGTERM handler
        yield cluster
    finally:
        ray.shutdown()
        signal.signal(signal.SIGTERM, sigterm)
        cluster.shutdown()


def wait_until_computing(pid: int, timeout: float = 60) -> None:
    """Until the process spends most of a core: a prefill replica busy with a prompt (idle, it only posts
    metrics once a second)."""
    process, deadline = psutil.Process(pid), time.monotonic() + timeout

    def cpu_seconds() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in [process, *process.children(recursive=True)])

    while True:
        before = cpu_seconds()
        time.sleep(0.3)
        if cpu_seconds() - before > 0.2:
            return
        assert time.monotonic() < deadline, "the prefill replica never started on the prompt"
