"""The HTTP face of the replicas: folio's own FastAPI app (the same routes, errors, auth, limits and
streaming as `folio serve`), run as a Ray Serve ingress whose engine is the replicas.

It tokenizes and validates here, so a replica only ever receives token ids, and admission counts every
replica's requests at once (max_num_seqs x replicas running, `max_queue` more waiting, then 429).
It checks `--api-key` against the salted digest that `build_application` binds in place of the key: Ray
shows a deployment's arguments to whoever reads its dashboard or state API.
"""

from __future__ import annotations

import asyncio
import logging

import ray
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Gauge
from ray.serve.handle import DeploymentHandle

from folio.engine_args import EngineArgs
from folio.loaders.catalog import resolve_model
from folio.loaders.model_loader import open_checkpoint
from folio.platform import default_device, resolve_dtype
from folio.scale_out.board import REPORT_PERIOD_S, ROUTER_REGISTRY, ReplicaMetricsCollector, ReplicaReport, board_for
from folio.scale_out.jobs import ReplicaDescription
from folio.scale_out.loopback import replica_grpc_on_loopback
from folio.scale_out.remote_engine import RemoteEngine
from folio.server.admission import Admission
from folio.server.app import create_app
from folio.server.auth import APIKeyDigest
from folio.server.context import ServerContext
from folio.server.model_card import ModelCard
from folio.server.serve import ServerOptions
from folio.server.served_models import OneModel

logger = logging.getLogger("folio")


class FolioIngress:
    async def __init__(
        self,
        engine: DeploymentHandle,
        args: EngineArgs,
        model_name: str,
        options: ServerOptions,
        max_replicas: int,
        api_key: APIKeyDigest | None = None,
    ) -> None:
        replica_grpc_on_loopback()
        checkpoint = open_checkpoint(
            resolve_model(args.model), resolve_dtype(args.dtype, default_device())[0], args.quantization
        )
        description: ReplicaDescription = await engine.describe.remote()
        self.engine = RemoteEngine(engine, description.max_model_len)
        self.context = ServerContext(
            engine=self.engine,
            tokenizer=checkpoint.tokenizer,
            model_name=model_name,
            vocab_size=checkpoint.config.vocab_size,
            hidden_size=checkpoint.config.hidden_size,
            admission=Admission(description.max_num_seqs * max_replicas, options.max_queue),
            limits=options.limits,
            chat=options.chat,
            model_card=ModelCard.describe(
                model_name, checkpoint.path, checkpoint.config, checkpoint.label, description.max_model_len
            ),  # fmt: skip
        )
        self.options = options
        # build_application binds a digest and no key; a key in `options` (bound by hand) still guards the app.
        self.api_key: APIKeyDigest | str | None = api_key if api_key is not None else options.api_key
        self.reports: list[ReplicaReport] = []
        self._app_name = ray.serve.get_replica_context().app_name
        self._board = board_for(self._app_name)
        await self._refresh()
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())

    def __serve_build_asgi_app__(self) -> FastAPI:
        registry = CollectorRegistry()
        registry.register(ReplicaMetricsCollector(lambda: self.reports))
        registry.register(ROUTER_REGISTRY)  # a registry is a collector too
        doc = ("Engine requests holding admission slots, all replicas together; new requests get 429 beyond "
               "max_num_seqs x replicas + --max-queue.")  # fmt: skip
        admitted = Gauge("folio:num_requests_admitted", doc, ["model_name"], registry=registry)
        admitted.labels(self.context.model_name).set_function(lambda: self.context.admission.in_flight)
        return create_app(OneModel(self.context), self.context.limits, registry, self.api_key, self.options.ui)

    async def _refresh(self) -> None:
        try:
            self.reports = await self._board.fresh.remote()
        except ray.exceptions.RayActorError:
            self._board = board_for(self._app_name)
            return
        self.engine.is_alive = any(report.alive for report in self.reports if report.role != "prefill")

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REPORT_PERIOD_S)
            try:
                await self._refresh()
            except Exception:
                logger.exception("could not read the replicas' reports")

    def __del__(self) -> None:
        refresher = getattr(self, "_refresher", None)
        if refresher is not None:
            refresher.cancel()
