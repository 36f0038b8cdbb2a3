"""Joining the ranks of one model: torch.distributed's TCP rendezvous, cores per rank, and a rank that
never outlives the process that started it."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

# How long a rank waits in a collective for the others. Ranks step in lockstep, so a wait this long
# means a peer hung; an idle engine keeps the ranks awake with a message well within it.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
KEEPALIVE_SECONDS = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_address(addr: str | None, port: int | None) -> tuple[str, int]:
    """The rendezvous point: given, else MASTER_ADDR/MASTER_PORT from the environment, else a free
    loopback port (one host)."""
    addr = addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    if port is None:
        port = int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else free_port()
    return addr, port


def join(rank: int, world_size: int, addr: str, port: int, device: torch.device) -> None:
    """Join the default process group: gloo on CPU, NCCL on CUDA."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)  # fmt: skip


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
