"""Build the Ray Serve application (an ingress in front of engine replicas) and run it.

`folio serve MODEL --replicas N` calls `serve_on_ray`; a Ray Serve config or a Python script can use
`build_application` directly (docs/scale-out.md). Replicas take `cpus_per_replica` of Ray's CPUs each
(all of a split model's ranks: on one node by a STRICT_PACK placement group, or with `--nnodes H` over H
nodes by a STRICT_SPREAD one, rank_hosts.py) and are pinned to their own cores where a host has enough;
the ingress takes none.

A Ray instance that folio starts listens on loopback only: Ray's services run whatever code a client that
reaches them sends, so a Ray port open on a network would make `--api-key` protect nothing. Only a cluster
given with `--ray-address` is joined as it is (docs/scale-out.md, "What must be trusted").
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import threading

import ray
from ray import serve
from ray.serve import context as serve_context
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.deployment import Application, Deployment
from ray.serve.schema import LoggingConfig

from folio.engine_args import EngineArgs
from folio.scale_out.board import NAMESPACE
from folio.scale_out.ingress import FolioIngress
from folio.scale_out.loopback import LOOPBACK, local_only, on_loopback_node
from folio.scale_out.options import ReplicaOptions
from folio.scale_out.replica import EngineReplica
from folio.scale_out.request_router import FolioRequestRouter
from folio.server.auth import APIKeyDigest
from folio.server.serve import ServerOptions, warn_if_open, where

logger = logging.getLogger("folio")


class ServeAddressTaken(RuntimeError):
    """Serve runs on the joined cluster with its proxy on another address than the one asked for."""


QUIET = LoggingConfig(enable_access_log=False)  # a log line per request and per call is Serve's default


def replica_cpus(options: ReplicaOptions, world_size: int) -> float:
    """Ray CPUs one replica takes, all of its ranks together."""
    if options.cpus_per_replica is not None:
        return options.cpus_per_replica
    total = ray.cluster_resources().get("CPU", os.cpu_count() or 1)
    return max(1.0, math.floor(total / options.most_engines))


def check_disaggregation(args: EngineArgs) -> None:
    """What handing KV blocks between engines needs, checked before anything starts."""
    if args.parallel_config().world_size > 1:
        raise ValueError("--disaggregate needs whole-model replicas (no -tp/-pp/-cp): KV blocks are handed over "
                         "whole")  # fmt: skip
    if not args.enable_prefix_caching:
        raise ValueError("--disaggregate hands prompts' KV over through the prefix cache: drop --no-prefix-caching")
    spec = args.speculative_config
    if spec is not None and spec.method == "draft":
        raise ValueError("--disaggregate does not hand over a draft model's KV: use ngram, suffix or lookahead")


def _engine_deployment(
    name: str, args: EngineArgs, server: ServerOptions, options: ReplicaOptions, cpus: float, scaling: dict
) -> Deployment:
    # Over several nodes, one bundle per node: the replica in the first, a RankHost in each other one. On one,
    # the replica's ranks are its own processes: a bundle per rank reserves their CPUs on the replica's node.
    bundles = args.nnodes if args.nnodes > 1 else args.parallel_config().world_size
    placement: dict = {}
    if bundles > 1:
        placement = {"placement_group_bundles": [{"CPU": cpus / bundles}] * bundles,
                     "placement_group_strategy": "STRICT_SPREAD" if args.nnodes > 1 else "STRICT_PACK"}  # fmt: skip
    router = RequestRouterConfig(
        request_router_class=f"{FolioRequestRouter.__module__}.{FolioRequestRouter.__qualname__}",
        request_router_kwargs={**options.routing.__dict__, "block_size": args.block_size},
    )
    return serve.deployment(
        EngineReplica,
        name=name,
        ray_actor_options={"num_cpus": cpus / bundles},
        # Each replica's engine queues its own requests; the ingress's admission bounds the total.
        max_ongoing_requests=args.max_num_seqs + server.max_queue,
        request_router_config=router,
        logging_config=QUIET,
        health_check_period_s=2.0,
        health_check_timeout_s=60.0,
        graceful_shutdown_timeout_s=server.grace_period,
        **scaling,
        **placement,
    )


def build_application(
    args: EngineArgs, model_name: str, server: ServerOptions | None = None, options: ReplicaOptions | None = None
) -> Application:
    """The ingress bound to its engine replicas, ready for `serve.run` (Ray must be initialised)."""
    server = server or ServerOptions()
    options = options or ReplicaOptions()
    if options.disaggregate:
        check_disaggregation(args)
    cpus = replica_cpus(options, args.parallel_config().world_size)
    pinned = int(cpus) if float(cpus).is_integer() and args.nnodes == 1 else 0
    scaling: dict = {"num_replicas": options.replicas}
    if options.autoscaling:
        scaling = {"autoscaling_config": AutoscalingConfig(
            min_replicas=options.min_replicas, max_replicas=options.max_replicas,
            initial_replicas=max(options.min_replicas or 0, 1),
            target_ongoing_requests=options.target_ongoing_requests, upscale_delay_s=5.0,
            downscale_delay_s=options.downscale_delay,
        )}  # fmt: skip
    if options.disaggregate:
        prefill = _engine_deployment("prefill", args, server, options, cpus, {"num_replicas": options.prefill_replicas})
        decode = _engine_deployment("decode", args, server, options, cpus, scaling)
        engines = decode.bind(args, model_name, pinned, "decode", prefill.bind(args, model_name, pinned, "prefill"),
                              first_core=pinned * options.prefill_replicas)  # fmt: skip
    else:
        engines = _engine_deployment("engine", args, server, options, cpus, scaling).bind(args, model_name, pinned)
    ingress = serve.deployment(
        serve.ingress()(FolioIngress),
        name="ingress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000,  # admission inside the app answers 429 long before this
        logging_config=QUIET,
        graceful_shutdown_timeout_s=server.grace_period,
    )
    # Ray shows a deployment's arguments (dashboard, state API): the key travels only as a salted digest.
    digest = APIKeyDigest.of(server.api_key) if server.api_key is not None else None
    keyless = dataclasses.replace(server, api_key=None)
    return ingress.bind(engines, args, model_name, keyless, options.most_replicas, digest)


def start_ray(options: ReplicaOptions) -> None:
    """Join the cluster at `options.ray_address` as given, or start a Ray instance of our own that listens
    on loopback only ("local": never one that RAY_ADDRESS or an earlier `ray start` points at)."""
    if ray.is_initialized():
        return
    if options.ray_address is not None:
        ray.init(address=options.ray_address, log_to_driver=True)
        return
    with local_only():
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=True,
                 _node_ip_address=LOOPBACK)  # fmt: skip
    if not on_loopback_node():  # a later Ray that ignores the switch: refuse, not expose
        node = ray.util.get_node_ip_address()
        ray.shutdown()
        raise RuntimeError(f"Ray started on {node}, not on loopback: its ports would be open to the network")


def start_http_proxy(host: str, port: int) -> None:
    """Start Serve's HTTP proxy on host:port. Where Serve already runs on the cluster (left by an earlier
    server, or another application's), Serve keeps the address it was first given and ignores this one with
    a log line: refuse rather than say we serve where nothing listens."""
    serve.start(http_options={"host": host, "port": port})
    running = serve_context._get_global_client().http_config  # no public API reads the proxy's address
    if (running.host, running.port) != (host, port):
        raise ServeAddressTaken(
            f"Ray Serve already runs on this cluster with its HTTP proxy on {running.host}:{running.port}: serve "
            f"there (--host {running.host} --port {running.port}) or stop it first (`serve shutdown`)"
        )


def run_application(
    args: EngineArgs, model_name: str, host: str, port: int, server: ServerOptions, options: ReplicaOptions
) -> None:
    """Start (or join) Ray, start Serve's HTTP proxy on host:port and run the application; returns once
    every replica is ready."""
    start_ray(options)
    start_http_proxy(host, port)
    deploy(args, model_name, server, options)


def deploy(args: EngineArgs, model_name: str, server: ServerOptions, options: ReplicaOptions) -> None:
    serve.run(build_application(args, model_name, server, options), name=options.app_name, route_prefix="/")


def stop_application(options: ReplicaOptions) -> None:
    serve.delete(options.app_name)
    with contextlib.suppress(ValueError):  # never created
        ray.kill(ray.get_actor(f"board:{options.app_name}", namespace=NAMESPACE))


def serve_on_ray(args: EngineArgs, host: str, port: int, server: ServerOptions, options: ReplicaOptions) -> None:
    """`folio serve --replicas N`: serve until SIGINT/SIGTERM, then stop the replicas and Ray."""
    warn_if_open(host, port, server.api_key)
    model_name = args.model
    stop = threading.Event()
    deployed = False
    try:
        start_ray(options)
        # After ray.init, which installs its own SIGTERM handler (one that aborts the process).
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            start_http_proxy(host, port)  # before anything of ours is on the cluster: a refusal deletes nothing
            deployed = True
            deploy(args, model_name, server, options)
            count = f"{options.min_replicas}-{options.max_replicas}" if options.autoscaling else str(options.replicas)
            if options.disaggregate:
                count = f"{options.prefill_replicas} prefill + {count} decode"
            logger.info("serving %s on Ray: %s replicas, %s routing, at %s", model_name, count,
                        options.routing.policy, where(host, port, server))  # fmt: skip
            while not stop.wait(1.0):
                pass
            logger.info("stopping the replicas")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        if ray.is_initialized():
            with contextlib.suppress(Exception):  # whatever failed, Ray's processes must still go
                if deployed:
                    stop_application(options)
                if options.ray_address is None:  # ours alone; on a joined cluster other apps may use Serve
                    serve.shutdown()
            ray.shutdown()  # stops a local instance; leaves a joined cluster running
    logger.info("server stopped")
