"""Keeping a Ray that folio starts on loopback: its services run what any client that reaches them sends
(Ray's security docs), so with `--host 127.0.0.1 --api-key K` an open Ray port would make K protect nothing.

- `local_only()`: Ray's local-only mode, its default on macOS and Windows (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0),
  for the ray.init call: the node's address is 127.0.0.1, and with that address the GCS, the raylet,
  workers, agents and metrics servers bind to 127.0.0.1. Elsewhere ray.init turns
  `_node_ip_address="127.0.0.1"` into the node's network address, and every one of them listens on all
  interfaces. The variable is read when Ray is imported, too early to set it here: the constant it sets is
  switched for the call instead.
- `replica_grpc_on_loopback()`: Ray Serve starts every replica's inter-deployment gRPC server on "[::]:0"
  (ray/serve/_private/replica.py), all interfaces, whatever the node's address; on a loopback node it is
  put on 127.0.0.1 too. Each replica calls it in its constructor, before Serve starts that server.
A cluster joined with `--ray-address` is left as it is.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Iterator
from typing import Any

import ray
import ray._private.ray_constants as ray_constants
from ray.serve._private import replica as serve_replica

LOOPBACK = "127.0.0.1"
_EVERY_INTERFACE = ("[::]", "0.0.0.0", "")


@contextlib.contextmanager
def local_only() -> Iterator[None]:
    previous = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = previous


def on_loopback_node() -> bool:
    return ipaddress.ip_address(ray.util.get_node_ip_address()).is_loopback


def replica_grpc_on_loopback() -> None:
    """In a replica's process: its inter-deployment gRPC server binds to loopback where the node is on it."""
    bind = serve_replica.add_port_to_grpc_server
    if getattr(bind, "keeps_loopback", False) or not on_loopback_node():
        return

    def on_loopback(server: Any, address: str) -> int:
        host, _, port = address.rpartition(":")
        return bind(server, f"{LOOPBACK}:{port}" if host in _EVERY_INTERFACE else address)

    on_loopback.keeps_loopback = True  # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = on_loopback
