"""How a step reaches every rank and its result comes back, with several steps in a pipeline at once.

The engine writes each message (a step, "stats", "stop") to rank 0's pipe. Each pipeline stage's first
rank (its leader) passes the message on to the next stage's leader before running it, and hands it
to its own stage's other ranks (a broadcast within the stage). The last stage's leader sends the
step's result to rank 0, which writes it to the engine's pipe. Point-to-point sends are posted
without waiting (a gloo send completes only once its receiver has posted the matching receive),
so stage 0 takes step k + 1 while the last stage still runs step k: with a pipeline of P stages the
engine keeps up to P steps in flight (engine_core.py), and the scheduler keeps their requests apart.

On rank 0 of a pipeline a thread receives the results, so that the last stage never waits on stage
0's compute; without a pipeline rank 0 reports its own result. Messages travel on their own gloo
groups (torch.distributed needs every rank to create every group, in the same order), never mixed
with the hidden states' sends, as typed msgpack (distributed/wire.py): a rank never unpickles what
another sent.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any, Literal

import torch
import torch.distributed as dist

from folio.distributed import rendezvous, wire
from folio.step import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("folio")

# Messages: engine -> rank 0 -> every rank ("step", SchedulerOutput) | ("stop", None) | ("keepalive",
# None); engine -> rank 0 only ("stats", None). Rank 0 -> engine: ("ready" | "ok" | "error", payload).
# The engine's pipe to rank 0 is its own child's; between ranks they travel as RankMessage (wire.py).
Message = tuple[str, Any]


@dataclass(frozen=True)
class RankMessage:
    """What the engine sends every rank, passed on from stage to stage."""

    kind: Literal["step", "stop", "keepalive"]
    step: SchedulerOutput | None = None


@dataclass(frozen=True)
class RankResult:
    """The last stage's answer to one step; None tells rank 0's results thread to stop."""

    output: ModelRunnerOutput | None


_READ_MESSAGE = wire.decoder(RankMessage)
_READ_RESULT = wire.decoder(RankResult)


class _Posted:
    """Point-to-point sends in progress; their buffers live until they complete."""

    def __init__(self) -> None:
        self.works: list[tuple[Any, torch.Tensor, torch.Tensor]] = []

    def send(self, value: object, dst: int, group: Any) -> None:
        data = torch.frombuffer(bytearray(wire.encode(value)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
        self.works.append((dist.isend(size, dst, group=group), size, data))
        self.works.append((dist.isend(data, dst, group=group), size, data))
        self.works = [entry for entry in self.works if not entry[0].is_completed()]

    def wait_all(self) -> None:
        for work, _, _ in self.works:
            work.wait()
        self.works = []


def _on_wire(message: Message) -> RankMessage:
    kind, payload = message
    return RankMessage(kind, _without_grammars(payload) if kind == "step" else None)  # type: ignore[arg-type]


def _without_grammars(step: SchedulerOutput) -> SchedulerOutput:
    """The step as every rank reads it: a request's grammar stays with the scheduler, which sends its
    bitmask in the step, and the runner never reads it (read back, its grammar would be compiled again)."""
    if not any(r.sampling_params.structured_output is not None for r in step.new_requests):
        return step
    requests = tuple(
        replace(r, sampling_params=replace(r.sampling_params, structured_output=None))
        if r.sampling_params.structured_output is not None else r
        for r in step.new_requests
    )  # fmt: skip
    return replace(step, new_requests=requests)


class StepRelay:
    """One rank's side of the relay. `tp_size` x `pp_size` ranks, global rank = stage * tp_size +
    tensor-parallel rank (a context-parallel model is one stage of all its ranks)."""

    def __init__(self, rank: int, stage_size: int, num_stages: int, conn: Connection | None) -> None:
        self.rank, self.conn = rank, conn
        self.stage, self.stage_rank = divmod(rank, stage_size)
        self.leader = self.stage * stage_size
        self.next_leader = self.leader + stage_size if self.stage < num_stages - 1 else None
        self.prev_leader = self.leader - stage_size if self.stage > 0 else None
        self.reporter = (num_stages - 1) * stage_size  # the last stage's leader: its result is the step's
        # Every rank creates every group, in the same order.
        stage_groups = [dist.new_group(list(range(s * stage_size, (s + 1) * stage_size)), backend="gloo")
                        for s in range(num_stages)]  # fmt: skip
        self.stage_group = stage_groups[self.stage]
        self.forward_group = dist.new_group(backend="gloo") if num_stages > 1 else None
        self.result_group = dist.new_group([0, self.reporter], backend="gloo") if self.reporter else None
        self.posted = _Posted()
        self.conn_lock = threading.Lock()
        self.collector: threading.Thread | None = None
        if rank == 0 and self.reporter:
            self.collector = threading.Thread(target=self._collect_results, name="folio-results", daemon=True)
            self.collector.start()

    def next_message(self) -> Message:
        """The next message for this rank, passed on to the next stage and to this stage's ranks."""
        if self.stage_rank == 0:
            if self.rank == 0:
                engine_message = self._read_engine()
                if engine_message[0] == "stats":
                    return engine_message  # answered by rank 0 alone
                message = _on_wire(engine_message)
            else:
                message = wire.receive(_READ_MESSAGE, self.prev_leader, self.forward_group)
            if self.next_leader is not None:
                self.posted.send(message, self.next_leader, self.forward_group)
        else:
            message = RankMessage("keepalive")
        if self.stage_group is not None and dist.get_world_size(self.stage_group) > 1:
            message = wire.broadcast(message, _READ_MESSAGE, self.leader, self.stage_group)
        return message.kind, message.step

    def _read_engine(self) -> Message:
        assert self.conn is not None
        try:
            if self.conn.poll(rendezvous.KEEPALIVE_SECONDS):
                return self.conn.recv()
        except EOFError:  # the engine is gone: stop every rank
            return ("stop", None)
        return ("keepalive", None)

    def report(self, result: object) -> None:
        """This rank's step result: the reporter's goes to the engine (through rank 0)."""
        if self.rank != self.reporter:
            return
        if self.rank == 0:
            self.answer(("ok", result))
        else:
            self.posted.send(RankResult(result), 0, self.result_group)  # type: ignore[arg-type]

    def answer(self, message: Message) -> None:
        assert self.conn is not None
        with self.conn_lock:
            self.conn.send(message)

    def _collect_results(self) -> None:
        """Rank 0's thread: each result from the last stage, in order, to the engine."""
        try:
            while (result := wire.receive(_READ_RESULT, self.reporter, self.result_group).output) is not None:
                self.answer(("ok", result))
        except Exception as exc:  # noqa: BLE001 - a dead peer ends the model; the engine must hear of it
            logger.error("rank 0 lost the last stage's results: %s", exc)
            with contextlib.suppress(OSError):
                self.answer(("error", f"rank {self.reporter}: {type(exc).__name__}: {exc}"))

    def stop(self) -> None:
        """After "stop": the reporter ends rank 0's results thread; posted sends finish."""
        if self.rank == self.reporter and self.rank != 0:
            self.posted.send(RankResult(None), 0, self.result_group)
        self.posted.wait_all()
        if self.collector is not None:
            self.collector.join(timeout=rendezvous.KEEPALIVE_SECONDS)
