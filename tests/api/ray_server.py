"""A `folio serve --replicas ...` process on a local Ray instance, and what its /metrics say, for the
Ray tests (tests/api/test_ray_replicas.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.api.server_runner import MODEL, free_port

KEY = "ray-test-key"


class RayServer:
    def __init__(self, *replica_flags: str, model: str = MODEL, cpus: int = 1) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="folio-ray-", suffix=".log")  # noqa: SIM115
        command = [sys.executable, "-m", "folio.cli", "serve", model, *(replica_flags or ("--replicas", "2")),
                   "--cpus-per-replica", str(cpus), "--port", str(self.port), "--num-kv-blocks", "256",
                   "--max-num-seqs", "8", "--api-key", KEY]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ.copy())

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
