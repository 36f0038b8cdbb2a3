"""The ingress's engine: the same narrow interface as `AsyncEngine` (server/engine_client/protocol.py), with
each prompt's samples sent as one `EngineJob` to the replica the router picks.

A replica that dies before anything of a job came back is not the client's problem: the job is sent
again (the router no longer offers the dead replica). One that dies mid-stream ends that call with a
503 the client may retry; the other calls, on other replicas, never notice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from folio.lora.adapter import LoRARequest
from folio.sampling_params import SamplingParams
from folio.scale_out.jobs import EngineJob, JobFailure
from folio.server.engine_client.updates import EngineDeadError, RequestFailedError, RequestUpdate, take_update

logger = logging.getLogger("folio")

REPLICA_LOST = (RayActorError, ActorDiedError, ActorUnavailableError)
NO_LORA = "Ray replicas serve no LoRA adapters yet: serve the model with one engine (no --replicas)"
RESENDS = 2  # times a job nothing came back from is sent again after its replica died


class ReplicaLostError(EngineDeadError):
    """The replica running a request died after the request's first output was sent."""


class RemoteEngine:
    def __init__(self, handle: DeploymentHandle, max_model_len: int) -> None:
        self.handle = handle.options(stream=True, method_name="generate")
        self.max_model_len = max_model_len
        self.is_alive = True  # kept by the ingress from the replicas' reports

    def generation(self, lora_name: str | None = None) -> RemoteGeneration:
        assert lora_name is None, "the replicas serve no LoRA adapters (the ingress lists none)"
        return RemoteGeneration(self)

    async def add_lora(self, request: LoRARequest) -> None:
        raise ValueError(NO_LORA)

    async def remove_lora(self, name: str) -> bool:
        raise ValueError(NO_LORA)


class RemoteGeneration:
    """One API call's jobs; updates come back on one queue as (choice index, update), as in
    `generation.Generation`. `close()` cancels every job's stream, which aborts it on its replica."""

    _closed = True  # class defaults: __del__ must work even if __init__ failed
    _pumps: list[asyncio.Task[None]] = []

    def __init__(self, engine: RemoteEngine) -> None:
        self._engine = engine
        self._queue: asyncio.Queue[tuple[int, RequestUpdate] | BaseException] = asyncio.Queue()
        self._open: set[int] = set()
        self._num_choices = 0
        self._pumps: list[asyncio.Task[None]] = []
        self._closed = False
        self._loop = asyncio.get_running_loop()

    def add(
        self, prompt_token_ids: list[int], params: list[SamplingParams], cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:  # fmt: skip
        if not self._engine.is_alive:
            raise EngineDeadError("no engine replica is running")
        job = EngineJob(list(prompt_token_ids), list(params), cache_salt, priority, self._num_choices)
        self._open.update(range(self._num_choices, self._num_choices + len(params)))
        self._num_choices += len(params)
        self._pumps.append(self._loop.create_task(self._pump(job)))

    async def _pump(self, job: EngineJob) -> None:
        for _ in range(RESENDS + 1):
            received = False
            stream = self._engine.handle.remote(job)
            try:
                async for item in stream:
                    received = True
                    self._queue.put_nowait(item.as_exception() if isinstance(item, JobFailure) else item)
                return
            except REPLICA_LOST as exc:
                if received:
                    self._queue.put_nowait(ReplicaLostError(
                        "the engine replica running this request stopped mid-answer; retry the request"))  # fmt: skip
                    return
                logger.warning("a replica died before answering; sending the job again (%s)", type(exc).__name__)
            except asyncio.CancelledError:
                stream.cancel()
                raise
            except Exception as exc:  # Ray's own failure, not the engine's: a 500 for this call only
                logger.exception("a job failed in transit")
                self._queue.put_nowait(RequestFailedError(f"the request could not reach an engine replica: {exc}"))
                return
        self._queue.put_nowait(EngineDeadError(f"the engine replicas died {RESENDS + 1} times running this request"))

    def __aiter__(self) -> RemoteGeneration:
        return self

    async def __anext__(self) -> tuple[int, RequestUpdate]:
        if not self._open:
            raise StopAsyncIteration
        return take_update(await self._queue.get(), self.close, self._open.discard)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._open = set()
        for pump in self._pumps:
            if not pump.done():
                pump.cancel()

    def __del__(self) -> None:
        # The collector may run this on any thread: cancel on the loop's own.
        if not self._closed and self._pumps:
            with contextlib.suppress(RuntimeError):  # the loop has closed: its tasks are gone already
                self._loop.call_soon_threadsafe(self.close)
