"""A Ray instance that `folio serve --replicas` starts listens on loopback only (folio/scale/deploy.py):
Ray's services run whatever a client that reaches them sends, so one port open on a network would make
`--api-key` protect nothing. Only a cluster given with `--ray-address` is joined as it is.

One Ray instance for the module, started in this process by `start_ray` as `folio serve --replicas`
starts it, with Serve's HTTP proxy, a task and an actor, so that every kind of Ray process is running: the
GCS, the raylet (node manager and object manager), the monitor, the dashboard head, the dashboard and
runtime-env agents, workers, Serve's controller and proxy.
"""

from __future__ import annotations

import ipaddress
import signal
import time
import warnings

import psutil
import pytest
import ray
import ray._private.ray_constants as ray_constants

from folio.scale.options import ReplicaOptions
from tests.api.server_runner import free_port

with warnings.catch_warnings():  # Serve's own pydantic deprecations, on import
    warnings.simplefilter("ignore")
    from ray import serve

    from folio.scale import deploy

# Ray's processes, by the names psutil reads (its workers retitle themselves "ray::<what they run>").
EXPECTED = ("gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::ServeController",
            "ray::ProxyActor", "ray::Pinger")  # fmt: skip


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)  # gRPC's IPv6 socket bound to ::ffff:127.0.0.1
    return (mapped or address).is_loopback


def bound_sockets() -> dict[str, list[str]]:
    """'name pid' -> 'ip:port' of every listening TCP socket and bound UDP socket of this process and the
    processes under it: the driver, and every Ray process it started (workers are the raylet's children)."""
    found: dict[str, list[str]] = {}
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
        try:
            name = process.name()
            sockets = process.net_connections(kind="inet")
        except psutil.NoSuchProcess:  # a worker that just exited
            continue
        for sock in sockets:
            if sock.status == psutil.CONN_LISTEN or (sock.status == psutil.CONN_NONE and sock.laddr):
                found.setdefault(f"{name} {process.pid}", []).append(f"{sock.laddr.ip}:{sock.laddr.port}")
    return found


@ray.remote
class Pinger:
    def ping(self) -> str:
        return "pong"


@pytest.fixture(scope="module")
def local_ray():
    """Ray as `folio serve --replicas` starts it, while RAY_ADDRESS names another cluster: folio starts its
    own all the same. Then Serve's HTTP proxy on 127.0.0.1 (as `--host 127.0.0.1` asks), a task, an actor."""
    assert not ray.is_initialized(), "another test left Ray running"
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("RAY_ADDRESS", "203.0.113.9:6379")  # never reached: folio starts its own instance
            deploy.start_ray(ReplicaOptions())
        deploy.start_http_proxy("127.0.0.1", free_port())
        assert ray.get(ray.remote(lambda: "done").remote()) == "done"
        pinger = Pinger.remote()
        assert ray.get(pinger.ping.remote()) == "pong"
        yield pinger
    finally:
        if ray.is_initialized():
            serve.shutdown()
        ray.shutdown()
        signal.signal(signal.SIGTERM, sigterm)


def test_every_ray_port_is_on_loopback(local_ray):
    deadline = time.monotonic() + 60
    while True:  # the agents open their ports a moment after ray.init returns
        found = bound_sockets()
        missing = [name for name in EXPECTED if not any(key.split()[0] == name for key in found)]
        if not missing:
            break
        assert time.monotonic() < deadline, f"no listening socket yet for {missing}: {found}"
        time.sleep(0.5)
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    assert ray_constants.ENABLE_RAY_CLUSTER  # folio's switch is back as Ray set it
    exposed = [f"{name}: {address}" for name, addresses in found.items() for address in addresses
               if not is_loopback(address.rsplit(":", 1)[0])]  # fmt: skip
    assert not exposed, "listening beyond loopback:\n" + "\n".join(exposed)


def test_is_loopback():
    assert all(map(is_loopback, ["127.0.0.1", "::1", "::ffff:127.0.0.1", "127.0.0.5"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.0.2.2", "fd00::2", "::ffff:192.0.2.2"]))


def test_a_given_cluster_is_joined_as_given(monkeypatch):
    """`--ray-address`: folio joins the cluster at that address as it is, in Ray's ordinary mode."""
    calls = []

    def init(**kwargs):
        calls.append((kwargs, ray_constants.ENABLE_RAY_CLUSTER))

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    deploy.start_ray(ReplicaOptions(ray_address="10.0.0.7:6379"))
    assert calls == [({"address": "10.0.0.7:6379", "log_to_driver": True}, True)]
