"""A replica split over several nodes: its other nodes' ranks, started by Ray where its placement group
put them.

A replica whose engine flags say `--nnodes H` gets a STRICT_SPREAD placement group of H bundles (one per
node, deploy.py). The replica itself runs in bundle 0, on the head node of its model; for each other
bundle it starts a `RankHost` actor, which spawns that node's ranks exactly as `folio worker` would,
joining the rendezvous at the replica's node address. The actors are the replica's children: if the
replica dies, Ray kills them, and their ranks die with them (PR_SET_PDEATHSIG), so a failed replica is
replaced whole.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from multiprocessing.process import BaseProcess

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from folio.config import ParallelConfig
from folio.distributed import rank_auth, rendezvous
from folio.engine_args import EngineArgs
from folio.worker.executor import start_ranks, stop_ranks


@ray.remote(num_cpus=0)  # its CPUs are the placement group bundle's
class RankHost:
    def __init__(self) -> None:
        self.processes: list[BaseProcess] = []

    def start(self, parallel: ParallelConfig, device: str, secret: str) -> int:
        """Spawn this node's ranks; returns their count. They run until the model stops or this actor goes."""
        per_node = parallel.ranks_per_node
        assert parallel.master_addr is not None and parallel.master_port is not None
        self.processes, _ = start_ranks(None, parallel.node_rank * per_node, per_node, parallel.world_size,
                                        parallel.master_addr, parallel.master_port, device, secret)  # fmt: skip
        return len(self.processes)

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]

    def stop(self) -> None:
        stop_ranks(self.processes)


def start_rank_hosts(args: EngineArgs, device: str) -> tuple[EngineArgs, list[ray.actor.ActorHandle]]:
    """For a replica split over `args.nnodes` nodes: the args its own engine runs with (the rendezvous at
    this node), and the started actors holding the other nodes' ranks."""
    if args.nnodes == 1:
        return args, []
    group = get_current_placement_group()
    if group is None or len(group.bundle_specs) < args.nnodes:
        raise ValueError(f"a replica over {args.nnodes} nodes needs a placement group of one bundle per node")
    args = replace(args, master_addr=ray.util.get_node_ip_address(), master_port=rendezvous.free_port(""))
    parallel = args.parallel_config()
    # This replica's own ranks read the secret from its environment (executor.py); Ray carries it to the
    # other nodes' ranks, on the cluster Ray's own trust covers.
    secret = rank_auth.secret_from_environment() or rank_auth.new_secret()
    os.environ[rank_auth.SECRET_ENV] = secret
    hosts = []
    for node_rank in range(1, args.nnodes):
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=node_rank)
        host = RankHost.options(scheduling_strategy=strategy).remote()  # type: ignore[attr-defined]
        hosts.append(host)
        host.start.remote(replace(parallel, node_rank=node_rank), device, secret)
    return args, hosts


def stop_rank_hosts(hosts: list[ray.actor.ActorHandle]) -> None:
    for host in hosts:
        with contextlib.suppress(Exception):  # already gone with its node
            ray.get(host.stop.remote(), timeout=30)
        ray.kill(host)
