"""folio's routing policy (routing.py) as a Ray Serve request router for the engine replicas.

Ray Serve runs this in the process that holds the handle (the ingress) and asks it for a ranking of
replicas per request; Serve then sends the request to the first rank's replica if that replica has room
(`max_ongoing_requests`), else tries the next rank. Loads are Serve's own counts of each replica's
requests in flight (cached, probed when stale), so several ingress processes see the same loads; the
prefix table is per ingress process. Serve ships this module by value: keep its globals picklable.
"""

from __future__ import annotations

import threading
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from folio.scale_out import board
from folio.scale_out.jobs import EngineJob
from folio.scale_out.routing import RoutingConfig, RoutingPolicy, prefix_digests


def _job_of(pending: PendingRequest | None) -> EngineJob | None:
    if pending is None:
        return None
    return next((arg for arg in pending.args if isinstance(arg, EngineJob)), None)


class FolioRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self.block_size = int(kwargs.pop("block_size", 16))
        self.policy = RoutingPolicy(RoutingConfig(**kwargs))
        self._lock = threading.Lock()  # the policy's tables, against Serve's routing tasks

    async def _loads(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Serve's cached counts of the replicas' requests in flight; the replicas whose count is stale are probed."""
        loads = {replica.replica_id: self._replica_queue_len_cache.get(replica.replica_id) for replica in replicas}
        stale = [replica for replica in replicas if loads[replica.replica_id] is None]
        if stale:
            for replica, queue_len in await self._probe_queue_lens(stale, 0):
                loads[replica.replica_id] = queue_len
        return {replica_id: load for replica_id, load in loads.items() if load is not None}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        job = _job_of(pending_request)
        if job is None or not candidate_replicas:
            return [candidate_replicas]
        loads = await self._loads(candidate_replicas)
        if not loads:  # nobody answered in time: let Serve probe them all again
            return [candidate_replicas]
        by_name = {replica.replica_id.unique_id: replica for replica in candidate_replicas}
        digests = self._digests(pending_request, job)
        with self._lock:
            decision = self.policy.choose(digests, {rid.unique_id: load for rid, load in loads.items()})
        chosen = by_name[decision.replica]
        pending_request.routing_context.folio_decision = decision  # type: ignore[union-attr]
        others = [replica for replica in candidate_replicas if replica is not chosen]
        return [[chosen], others] if others else [[chosen]]

    def _digests(self, pending: PendingRequest, job: EngineJob) -> list[bytes]:
        """The prompt's block digests, hashed once per request however often Serve asks to route it."""
        context = pending.routing_context
        digests = getattr(context, "folio_digests", None)
        if digests is None:
            digests = prefix_digests(job.prompt_token_ids, self.block_size, job.cache_salt,
                                     self.policy.config.max_prefix_blocks)  # fmt: skip
            context.folio_digests = digests  # type: ignore[attr-defined]
        return digests

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        job = _job_of(pending_request)
        if job is None:
            return
        digests = self._digests(pending_request, job)
        with self._lock:
            self.policy.routed(digests, replica_id.unique_id)
        decision = getattr(pending_request.routing_context, "folio_decision", None)
        went_as_chosen = decision is not None and decision.replica == replica_id.unique_id
        reason = decision.reason if went_as_chosen else "fallback"
        board.ROUTED.labels(replica_id.unique_id, reason).inc()
        if went_as_chosen and decision.matched_blocks:
            board.MATCHED_BLOCKS.labels(replica_id.unique_id).inc(decision.matched_blocks)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        with self._lock:
            self.policy.forget(replica_id.unique_id)
