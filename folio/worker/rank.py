"""One rank of a split model: it loads its shard (its stage's layers, its columns of them), then runs
every step the engine sends.

The scheduler stays single, in the engine process, and talks to rank 0 only (a pipe); each step's
`SchedulerOutput` (a value) reaches every rank through the relay (step_relay.py: stage to stage, and
within a stage by broadcast), every rank runs the same `ModelRunner.execute` on its shard (the
collectives inside the layers keep a stage's ranks in lockstep; hidden states flow from stage to
stage), and the last stage's first rank (rank 0 itself without a pipeline) has its
`ModelRunnerOutput` sent back. Ranks on other hosts get everything they need, the spec included,
from rank 0, so `folio worker` needs only the rendezvous.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from folio.config import CacheConfig, ParallelConfig, SpeculativeConfig
from folio.distributed import rank_auth, rendezvous, wire
from folio.distributed.pipeline_parallel import building_stage
from folio.distributed.tensor_parallel import COMM, CommStats, building
from folio.distributed.topology import join_context, join_groups
from folio.loaders.catalog import resolve_model
from folio.loaders.model_loader import load_model
from folio.memory import reuse_large_allocations
from folio.spec_decode.factory import make_proposer
from folio.worker.model_runner import ModelRunner
from folio.worker.step_relay import StepRelay

logger = logging.getLogger("folio")


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank builds, as values: rank 0 hands it to the others."""

    model: str  # as the user named it (a catalog name or a path), resolved on each host
    dtype: torch.dtype
    quantization: str | None
    cache: CacheConfig
    num_blocks: int
    speculative: SpeculativeConfig | None
    parallel: ParallelConfig


_READ_SPEC = wire.decoder(WorkerSpec)


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs and how it finds the others."""

    rank: int
    local_rank: int
    world_size: int
    local_ranks: int
    master_addr: str
    master_port: int
    device: str


@dataclass(frozen=True)
class ReadyReport:
    weight_bytes: int  # rank 0's shard
    quantization: str
    load_seconds: float
    threads: int


def run_rank(place: RankPlace, spec: WorkerSpec | None, conn: Connection | None, environment: dict[str, str]) -> None:
    """A rank's process: rank 0 gets `spec` and the engine's pipe; the others get both as None. It runs
    with the engine's `environment` as it was when the ranks started (folio's switches, OMP_NUM_THREADS)."""
    os.environ.clear()
    os.environ.update(environment)
    rendezvous.die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {place.rank} %(levelname)s %(message)s")
    try:
        threads = rendezvous.pin_cores(place.local_rank, place.local_ranks)
        device = torch.device(place.device)
        secret = environment.get(rank_auth.SECRET_ENV, "")
        rendezvous.join(place.rank, place.world_size, place.master_addr, place.master_port, device, secret)
        # Values travel on a gloo group: NCCL moves only device tensors.
        control = dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD
        spec = wire.broadcast(spec, _READ_SPEC, 0, control)
        runner, report = _build(spec, place, device, threads, control)
        if device.type == "cpu":  # as the engine does once its model and pool are loaded (folio/memory.py)
            reuse_large_allocations()
        parallel = spec.parallel
        stage_size = parallel.tensor_parallel_size * parallel.context_parallel_size
        relay = StepRelay(place.rank, stage_size, parallel.pipeline_parallel_size, conn)
        dist.barrier(group=control)
        if conn is not None:
            relay.answer(("ready", report))
        _serve(runner, relay)
    except BaseException as exc:  # noqa: BLE001 - whatever ended this rank is reported, then it exits
        logger.error("rank %d failed: %s", place.rank, traceback.format_exc())
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(("error", f"rank {place.rank}: {type(exc).__name__}: {exc}"))
        os._exit(1)  # a peer may be stuck in a collective: do not wait on process-group teardown
    # Every rank got "stop" through the relay; gloo's teardown at exit aborts noisily when its
    # peers are already gone, and there is nothing left to flush but the log.
    logging.shutdown()
    os._exit(0)


def _build(
    spec: WorkerSpec, place: RankPlace, device: torch.device, threads: int, control: Any
) -> tuple[ModelRunner, ReadyReport]:
    parallel = spec.parallel
    # Ranks on one CPU host exchange through shared memory unless told to use gloo.
    shm = device.type == "cpu" and parallel.nnodes == 1 and parallel.cpu_collectives == "shm"
    if parallel.context_parallel_size > 1:
        role = join_context(place.rank, parallel.context_parallel_size, control, shm)
    else:
        role = join_groups(place.rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size, control, shm,
                           parallel.pipeline_layers)  # fmt: skip
    with building(role.tp), building_stage(role.stage):
        loaded = load_model(resolve_model(spec.model), spec.dtype, device, spec.quantization)
    runner = ModelRunner(loaded.model, loaded.config, spec.cache, spec.num_blocks, spec.dtype, device, spec.speculative,
                         parallel.micro_batches, role.context)  # fmt: skip
    speculative = spec.speculative
    if role.reports and speculative is not None:  # only the reporting rank's drafts reach the scheduler
        draft = None
        if speculative.draft_model is not None:  # whole on rank 0: built outside `building`
            draft = load_model(resolve_model(speculative.draft_model), spec.dtype, device,
                               speculative.draft_quantization).model  # fmt: skip
        runner.proposer = make_proposer(speculative, draft, spec.num_blocks, spec.cache.block_size, spec.dtype,
                                        device)  # fmt: skip
    logger.info("rank %d of %d (stage %d, tensor-parallel rank %d, context-parallel rank %d): %.1f MiB of weights "
                "(%s), %d threads", place.rank, place.world_size, role.stage.stage, role.tp.rank, role.context.rank,
                loaded.weight_bytes / 2**20, loaded.quantization, threads)  # fmt: skip
    return runner, ReadyReport(loaded.weight_bytes, loaded.quantization, loaded.load_seconds, threads)


def _serve(runner: ModelRunner, relay: StepRelay) -> None:
    while True:
        kind, payload = relay.next_message()
        if kind == "stop":
            relay.stop()
            return
        if kind == "stats":
            relay.answer(("ok", CommStats(COMM.seconds, COMM.calls, COMM.bytes)))
        elif kind == "step":
            relay.report(runner.execute(payload))
