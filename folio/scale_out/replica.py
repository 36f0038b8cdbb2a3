"""One engine replica: a whole folio engine (its own KV cache and prefix cache) in a Ray Serve replica.

The ingress sends it `EngineJob`s through a Serve handle and reads back a stream of `(choice index,
RequestUpdate)`. A cancelled stream (the client left, or the ingress gave up) closes the generation,
which aborts its requests and frees their blocks. Ray Serve calls `check_health`: an engine whose
thread died fails it, and Serve replaces the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator

import ray
from prometheus_client import generate_latest
from ray import serve
from ray.serve.handle import DeploymentHandle

from folio.engine.engine_core import EngineCore
from folio.engine.kv_transfer import KVBlocks
from folio.engine_args import EngineArgs
from folio.platform import default_device
from folio.scale_out.board import REPORT_PERIOD_S, ReplicaReport, board_for
from folio.scale_out.disaggregation import TransferMetrics, prefill_and_export, pull_prefix
from folio.scale_out.jobs import EngineJob, JobFailure, ReplicaDescription
from folio.scale_out.loopback import replica_grpc_on_loopback
from folio.scale_out.rank_hosts import start_rank_hosts, stop_rank_hosts
from folio.server.engine_client.thread import AsyncEngine
from folio.server.engine_client.updates import EngineDeadError, RequestUpdate
from folio.server.metrics import ServerMetrics

logger = logging.getLogger("folio")


def pin_to_cores(rank: int, cores_per_replica: int, first_core: int = 0) -> None:
    """Give replica `rank` its own cores when they exist (as the split model's ranks get theirs), so
    replicas on one host never share a core's caches; `first_core` skips another deployment's cores."""
    available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    first = first_core + rank * cores_per_replica
    if cores_per_replica < 1 or first + cores_per_replica > len(available):
        return
    os.sched_setaffinity(0, available[first : first + cores_per_replica])


class EngineReplica:
    """`role`: "engine" (whole requests), "prefill" (computes prompts for decode replicas) or "decode"
    (gets each prompt's KV from the `prefill` deployment, then generates)."""

    def __init__(
        self, args: EngineArgs, model_name: str, cores_per_replica: int = 0, role: str = "engine",
        prefill: DeploymentHandle | None = None, first_core: int = 0,
    ) -> None:  # fmt: skip
        replica_grpc_on_loopback()
        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        self.role = role
        self._app_name = context.app_name
        if cores_per_replica:
            pin_to_cores(context.rank.local_rank, cores_per_replica, first_core)
        # A model split over several nodes: the other nodes' ranks first, then this node's engine joins them.
        args, self.rank_hosts = start_rank_hosts(args, args.device or str(default_device()))
        self.core = EngineCore.from_engine_args(args)
        self.metrics = ServerMetrics(self.core, model_name)
        self.prefill_handle = prefill
        self.transfers = TransferMetrics(self.metrics.registry)
        eos = frozenset(self.core.model_config.eos_token_ids)
        self.engine = AsyncEngine(self.core, self.core.tokenizer, eos, observer=self.metrics)
        self._board = board_for(self._app_name)
        self._reporter = asyncio.get_event_loop().create_task(self._report_forever())
        logger.info("%s replica %s serving %s (KV cache %d tokens)", role, self.name, model_name,
                    self.core.make_stats().kv_capacity_tokens)  # fmt: skip

    # -- what the ingress calls ----------------------------------------------------------------------
    def describe(self) -> ReplicaDescription:
        core = self.core
        return ReplicaDescription(core.max_model_len, core.kv.block_size,
                                  core.scheduler_config.max_num_seqs)  # fmt: skip

    async def generate(self, job: EngineJob) -> AsyncIterator[tuple[int, RequestUpdate] | JobFailure]:
        generation = self.engine.generation()
        try:
            if self.prefill_handle is not None:
                await pull_prefix(self.engine, self.prefill_handle, job, self.transfers)
            generation.add(job.prompt_token_ids, job.params, job.cache_salt, job.priority)
            async for index, update in generation:
                yield job.first_index + index, update
        except Exception as exc:  # the engine's refusal or failure, as a value the ingress re-raises
            yield JobFailure.of(exc)
        finally:
            generation.close()

    async def prefill(self, job: EngineJob, skip: int) -> KVBlocks:
        """For a decode replica: the prompt's KV blocks after the first `skip`, computed here."""
        return await prefill_and_export(self.engine, job, skip)

    # -- what Ray Serve calls ------------------------------------------------------------------------
    def check_health(self) -> None:
        if not self.engine.is_alive:
            raise EngineDeadError(f"replica {self.name}: the engine thread has stopped")

    def record_routing_stats(self) -> dict[str, float]:
        stats = self.core.make_stats()
        return {"running": stats.num_running, "waiting": stats.num_waiting, "kv_usage": stats.kv_usage_ratio}

    def report(self) -> ReplicaReport:
        stats = self.core.make_stats()
        return ReplicaReport(
            replica=self.name,
            role=self.role,
            pid=os.getpid(),
            host=socket.gethostname(),
            alive=self.engine.is_alive,
            running=stats.num_running,
            waiting=stats.num_waiting,
            kv_usage=stats.kv_usage_ratio,
            metrics_text=generate_latest(self.metrics.registry).decode(),
        )

    async def _report_forever(self) -> None:
        while True:
            try:
                await self._board.post.remote(self.report())
            except ray.exceptions.RayActorError:  # the board went with its owner: make a new one
                self._board = board_for(self._app_name)
            except Exception:
                logger.exception("replica %s could not post its report", self.name)
            await asyncio.sleep(REPORT_PERIOD_S)

    def __del__(self) -> None:
        """Serve's graceful shutdown: stop reporting, stop the engine (and any ranks it started)."""
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:
            reporter.cancel()
        with contextlib.suppress(Exception):
            self._board.withdraw.remote(self.name)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        stop_rank_hosts(getattr(self, "rank_hosts", []))
