"""Joining the ranks of one model: torch.distributed's TCP rendezvous, cores per rank, and a rank that
never outlives the process that started it.

Rank 0 hosts the rendezvous store on a socket it binds itself, to the rendezvous address alone (torch's
own store listens on every interface): loopback for one host. Every rank proves it holds the rank secret
on that store (rank_auth.py) before it joins the process group."""

from __future__ import annotations

import ctypes
import ipaddress
import os
import signal
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from folio.distributed.rank_auth import SECRET_ENV, RankAuthError, authenticate

# How long a rank waits in a collective for the others. Ranks step in lockstep, so a wait this long
# means a peer hung; an idle engine keeps the ranks awake with a message well within it.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
KEEPALIVE_SECONDS = 30.0
STORE_BACKLOG = 128  # connections the store's socket queues: a few per rank as they join


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` ("": on every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def master_address(addr: str | None, port: int | None) -> tuple[str, int]:
    """The rendezvous point: given, else MASTER_ADDR/MASTER_PORT from the environment, else a free
    loopback port (one host)."""
    addr = addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    if port is None:
        port = int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else free_port()
    return addr, port


def _listening_socket(addr: str, port: int) -> int:
    """A socket listening on addr:port alone; its file descriptor, for the store to take over."""
    family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(where)
    listener.listen(STORE_BACKLOG)
    return listener.detach()


def join(rank: int, world_size: int, addr: str, port: int, device: torch.device, secret: str) -> None:
    """Meet the other ranks at addr:port, authenticate them (RankAuthError if one fails) and join the
    default process group: gloo on CPU, NCCL on CUDA."""
    if not secret:
        raise RankAuthError(f"no rank secret: the ranks of a model authenticate each other with {SECRET_ENV}")
    store = dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=COLLECTIVE_TIMEOUT,
                          wait_for_workers=False,
                          master_listen_fd=_listening_socket(addr, port) if rank == 0 else None)  # fmt: skip
    authenticate(store, rank, world_size, secret)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)


def loopback_environment(addr: str) -> dict[str, str]:
    """Where the rendezvous is on loopback (one host), gloo's own sockets go there too: by default gloo
    listens on whatever this host's name resolves to, which may be a public address."""
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return {}
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")] if loopback else []
    return {"GLOO_SOCKET_IFNAME": names[0]} if names else {}


def pin_cores(local_rank: int, local_ranks: int) -> int:
    """Give this rank its own share of the cores this process may use (ranks on one host must not
    fight over them); returns the thread count set."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    share = max(1, len(cores) // local_ranks)
    mine = cores[local_rank * share : (local_rank + 1) * share] or cores[-share:]
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    return len(mine)


def die_with_parent() -> None:
    """Linux: have the kernel send SIGTERM to this process when the process that started it exits,
    however it exits (a SIGKILLed server leaves no rank behind)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
