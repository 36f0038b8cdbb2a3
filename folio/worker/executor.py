"""The engine's side of a split model (tensor and/or pipeline parallel): it starts this host's ranks,
sends each step to rank 0 and returns the step's result, and stops every rank on exit or when any of
them dies.

It stands where an in-process `ModelRunner` would (`execute(SchedulerOutput) -> ModelRunnerOutput`),
so the scheduler and everything above it do not know the model is split.

`folio worker` (`run_worker_host`): a host other than the head one starts its share of the ranks, which
join the head host's rendezvous (MASTER_ADDR:MASTER_PORT), prove they hold the model's rank secret
(FOLIO_RANK_SECRET, the head's), and receive the model, the cache size and every other setting from rank
0, so the command names only where to meet.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

from folio.config import ModelConfig, ParallelConfig
from folio.distributed import rank_auth, rendezvous
from folio.distributed.tensor_parallel import CommStats
from folio.step import ModelRunnerOutput, SchedulerOutput
from folio.worker.rank import RankPlace, ReadyReport, WorkerSpec, run_rank

logger = logging.getLogger("folio")
STOP_SECONDS = 10.0


@dataclass(frozen=True)
class WorkerLaunch:
    """What an engine needs to start ranks that load the model themselves."""

    model: str  # as the user named it: each rank resolves it on its own host
    quantization: str | None
    parallel: ParallelConfig


class WorkerDiedError(RuntimeError):
    """A rank died or failed: the model cannot run another step (the engine must stop)."""


def rank_context() -> BaseContext:
    """Ranks fork from multiprocessing's fork server, which imported torch and folio once: spawning a
    fresh interpreter per rank re-imported them, ~4 s of every split model's start. The server itself
    never runs a step, so a rank still starts with no threads and no OpenMP state; it exits with the
    engine's process, and the ranks with it (rendezvous.die_with_parent). Spawn where there is no fork
    (Windows)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([run_rank.__module__])  # takes effect when the server starts
    return context


def start_ranks(
    spec: WorkerSpec | None, first_rank: int, count: int, world_size: int, addr: str, port: int, device: str,
    secret: str,
) -> tuple[list[BaseProcess], Any]:  # fmt: skip
    """Spawn ranks [first_rank, first_rank + count) of this host; rank 0 (if among them) gets `spec`
    and the returned end of its pipe. They prove `secret` to each other before anything else crosses."""
    context = rank_context()
    ours, theirs = context.Pipe() if first_rank == 0 else (None, None)
    # The fork server's environment is the one it started with; a rank gets today's, and the secret.
    environment = {**rendezvous.loopback_environment(addr), **os.environ, rank_auth.SECRET_ENV: secret}
    processes = []
    for local in range(count):
        rank = first_rank + local
        place = RankPlace(rank, local, world_size, count, addr, port, device)
        args = (place, spec, theirs, environment) if rank == 0 else (place, None, None, environment)
        process = context.Process(target=run_rank, args=args, name=f"folio-rank-{rank}", daemon=True)
        process.start()
        processes.append(process)
    if theirs is not None:
        theirs.close()  # only the child holds it now: its death reads as EOF here
    return processes, ours


def stop_ranks(processes: list[BaseProcess]) -> None:
    for process in processes:
        process.join(timeout=STOP_SECONDS)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(timeout=STOP_SECONDS)


class SplitModelExecutor:
    def __init__(self, spec: WorkerSpec, config: ModelConfig, device: str) -> None:
        self.config = config  # what callers read from an in-process runner
        parallel = spec.parallel
        addr, port = rendezvous.master_address(parallel.master_addr, parallel.master_port)
        secret = rank_auth.secret_from_environment()
        if secret is None:
            secret = rank_auth.new_secret()
            if parallel.nnodes > 1:
                logger.warning("no %s was set, so this head host drew one: start `folio worker` on the other hosts "
                               "with %s=%s", rank_auth.SECRET_ENV, rank_auth.SECRET_ENV, secret)  # fmt: skip
        self.processes, self.conn = start_ranks(spec, 0, parallel.ranks_per_node, parallel.world_size, addr, port,
                                                device, secret)  # fmt: skip
        self.stopped = False
        self.pending = 0  # steps sent whose results have not been read
        if parallel.nnodes > 1:
            logger.info("waiting for %d more ranks to join at %s:%d", parallel.world_size - parallel.ranks_per_node,
                        addr, port)  # fmt: skip
        self.ready: ReadyReport = self._receive()
        logger.info("%d ranks ready (%d on this host)", parallel.world_size, len(self.processes))

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(out)
        return self.collect()

    def submit(self, out: SchedulerOutput) -> None:
        """Start a step; results come back in the order steps were submitted (`collect`)."""
        self._send(("step", out))
        self.pending += 1

    def collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's result (waits for it)."""
        assert self.pending, "no step is in flight"
        result = self._receive()
        self.pending -= 1
        return result

    def comm_stats(self) -> CommStats:
        """Rank 0's time in collectives so far (between steps: none may be in flight)."""
        assert not self.pending, "comm_stats with steps in flight would read a step's result as the answer"
        self._send(("stats", None))
        return self._receive()

    def _send(self, message: tuple[str, Any]) -> None:
        if self.stopped:
            raise WorkerDiedError("the model's ranks have stopped")
        try:
            self.conn.send(message)
        except OSError as exc:
            self._fail(f"rank 0 is gone ({exc})")

    def _receive(self) -> Any:
        while True:
            ready = wait([self.conn, *(p.sentinel for p in self.processes)])
            if self.conn in ready:
                try:
                    kind, payload = self.conn.recv()
                except EOFError:
                    self._fail(f"rank 0 exited (code {self.processes[0].exitcode})")
                if kind == "error":
                    self._fail(payload)
                return payload
            for process in self.processes:
                if process.sentinel in ready and process.exitcode is not None:
                    self._fail(f"{process.name} exited (code {process.exitcode})")

    def _fail(self, why: str) -> None:
        logger.critical("a rank of the split model failed: %s; stopping every rank", why)
        self.stopped = True
        for process in self.processes:
            if process.is_alive():
                process.kill()
        stop_ranks(self.processes)
        raise WorkerDiedError(f"a rank of the split model failed: {why}")

    def shutdown(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        with contextlib.suppress(OSError):
            self.conn.send(("stop", None))
        stop_ranks(self.processes)
        self.conn.close()


def run_worker_host(parallel: ParallelConfig, device: str) -> int:
    """Run ranks [node_rank * per_node, ...) until they end; returns the worst exit code."""
    if parallel.node_rank == 0:
        raise ValueError("node rank 0 is the head host: start it with `folio serve|run|bench`, not `folio worker`")
    addr = parallel.master_addr or os.environ.get("MASTER_ADDR")
    port = parallel.master_port or (int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else None)
    if addr is None or port is None:
        raise ValueError("a worker host needs the head's rendezvous: --master-addr and --master-port (or "
                         "MASTER_ADDR and MASTER_PORT)")  # fmt: skip
    secret = rank_auth.secret_from_environment()
    if secret is None:
        raise ValueError(f"a worker host needs the model's rank secret: set {rank_auth.SECRET_ENV} to the value the "
                         "head host was given (or logged when it drew one)")  # fmt: skip
    per_node = parallel.ranks_per_node
    first = parallel.node_rank * per_node
    processes, _ = start_ranks(None, first, per_node, parallel.world_size, addr, port, device, secret)
    logger.info("ranks %d-%d of %d started, joining %s:%d", first, first + per_node - 1, parallel.world_size, addr,
                port)  # fmt: skip

    def forward_signal(sig: int, frame: object) -> None:
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, forward_signal)
    try:
        for process in processes:
            process.join()
    except KeyboardInterrupt:
        forward_signal(signal.SIGINT, None)
    finally:
        stop_ranks(processes)
        signal.signal(signal.SIGTERM, previous)
    return max((p.exitcode or 0 for p in processes), default=0) and 1
