"""A Ray instance that `folio serve --replicas` starts listens on loopback only (folio/scale_out/deploy.py);
every listener of the shared replica server is checked in tests/api/test_ray_replicas.py, which starts
that server with RAY_ADDRESS naming another cluster. Here, without a Ray of their own: what counts as
loopback, and that a cluster given with `--ray-address` is joined as it is."""

from __future__ import annotations

import ray
import ray._private.ray_constants as ray_constants
from ray.serve._private import replica as serve_replica

from folio.scale_out import deploy
from folio.scale_out.loopback import replica_grpc_on_loopback
from folio.scale_out.options import ReplicaOptions
from tests.api.ray_server import is_loopback


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


def test_folio_starts_ray_in_local_only_mode_and_puts_the_switch_back(monkeypatch):
    calls = []

    def init(**kwargs):
        calls.append((kwargs, ray_constants.ENABLE_RAY_CLUSTER))

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    before = ray_constants.ENABLE_RAY_CLUSTER
    deploy.start_ray(ReplicaOptions())
    [(kwargs, switch)] = calls
    assert kwargs["address"] == "local" and kwargs["_node_ip_address"] == "127.0.0.1" and switch is False
    assert before == ray_constants.ENABLE_RAY_CLUSTER


def test_a_replicas_internal_grpc_server_binds_to_loopback_on_a_loopback_node(monkeypatch):
    bound = []
    monkeypatch.setattr(serve_replica, "add_port_to_grpc_server", lambda server, address: bound.append(address))
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "192.0.2.2")
    replica_grpc_on_loopback()  # a joined cluster's node: left as Serve binds it
    serve_replica.add_port_to_grpc_server(None, "[::]:0")
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    replica_grpc_on_loopback()
    replica_grpc_on_loopback()  # twice in one process (two deployments): wrapped once
    serve_replica.add_port_to_grpc_server(None, "[::]:0")
    serve_replica.add_port_to_grpc_server(None, "10.0.0.1:7000")
    assert bound == ["[::]:0", "127.0.0.1:0", "10.0.0.1:7000"]
