"""An attacker at a split model's rendezvous: it knows folio's protocol but not the rank secret.

`python -m tests.distributed.fake_rank master PORT MARKER` answers at the rendezvous as rank 0 before the
real head does; `... last_stage PORT MARKER` joins a pipeline-parallel head as its last stage, rank 1.
Either way it plays the challenge with a wrong secret and then goes on as if it had passed: it joins the
process group and sends a pickle whose unpickling creates MARKER. A rank that unpickled what it received
(folio before its ranks authenticated and spoke typed messages) would run that code; folio's ranks must
end the meeting at the challenge, so MARKER never exists."""

from __future__ import annotations

import contextlib
import pathlib
import pickle
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from folio.distributed import rank_auth

WORLD = 2


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # unpickling calls pathlib.Path(marker).touch()
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def _challenge(store: dist.TCPStore, rank: int) -> None:
    """The challenge with a wrong secret; carries on when the other side never answers (an older folio)."""
    with contextlib.suppress(RuntimeError):  # RankAuthError, or the store's timeout
        rank_auth.authenticate(store, rank, WORLD, "not-the-secret")


def _as_tcp_init(store: dist.TCPStore) -> dist.PrefixStore:
    """The store as `init_method="tcp://..."` hands it to the process group (folio's ranks joined so)."""
    return dist.PrefixStore("default_pg", store)


def as_master(port: int, marker: str) -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(16)
    # Long enough for a worker to start on a busy machine; only an older folio never answers the challenge.
    store = dist.TCPStore("127.0.0.1", port, WORLD, True, timedelta(seconds=90), wait_for_workers=False,
                          master_listen_fd=listener.detach())  # fmt: skip
    _challenge(store, 0)
    dist.init_process_group("gloo", store=_as_tcp_init(store), rank=0, world_size=WORLD, timeout=timedelta(seconds=60))
    dist.broadcast_object_list([Payload(marker)], src=0)  # what a worker read its settings from


def as_last_stage(port: int, marker: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, WORLD, False, timedelta(seconds=90))
    _challenge(store, 1)
    dist.init_process_group("gloo", store=_as_tcp_init(store), rank=1, world_size=WORLD, timeout=timedelta(seconds=60))
    dist.broadcast_object_list([None], src=0)  # the settings from rank 0
    # The groups rank 1 of a two-stage pipeline creates (step_relay.py), in the same order.
    for ranks in ([0], [1]):
        dist.new_group(ranks, backend="gloo")
    dist.new_group(backend="gloo")
    results = dist.new_group([0, 1], backend="gloo")
    dist.barrier()
    data = torch.frombuffer(bytearray(pickle.dumps(Payload(marker))), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.long), 0, group=results)  # "the step's result"
    dist.send(data, 0, group=results)


if __name__ == "__main__":
    role, port, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    (as_master if role == "master" else as_last_stage)(port, marker)
