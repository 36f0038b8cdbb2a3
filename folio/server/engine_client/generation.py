"""`Generation`: the engine requests behind one API call, whichever engine runs them.

The engine may be a loop on a thread of this process (`AsyncEngine`) or in a process of its own
(server/engine_client/process.py); both take requests, streams and aborts through `RequestSink`.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from folio.engine.request import Request
from folio.sampling_params import SamplingParams
from folio.server.engine_client.updates import LoopMailbox, RequestUpdate, Stream, take_update


class RequestSink(Protocol):
    def new_request(
        self, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None, priority: int,
        lora_name: str | None = None,
    ) -> Request: ...  # fmt: skip

    def submit(self, streams: list[Stream]) -> None: ...

    def abort(self, request_id: str) -> None: ...


class Generation:
    """The engine requests behind one API call (prompts x samples), numbered as its choices.

    Their updates arrive on one queue as (choice index, update). Iterating ends when every choice has
    finished; a failed choice or a dead engine raises. `close()` aborts every choice that has not
    finished: it is synchronous and idempotent, so it is safe in any finally block, a cancelled
    task's included, and it also runs if the object is dropped unclosed.
    """

    _open: dict[int, str] = {}  # class defaults: __del__ must work even if __init__ failed
    _closed = True

    def __init__(self, engine: RequestSink, lora_name: str | None = None) -> None:
        self._engine = engine
        self._lora_name = lora_name  # the LoRA adapter every request of the call runs with
        self._mailbox = LoopMailbox(asyncio.get_running_loop())
        self._open = {}  # choice index -> request id, until that choice finishes
        self._num_choices = 0
        self._closed = False

    def add(
        self, prompt_token_ids: list[int], params: list[SamplingParams], cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:  # fmt: skip
        """The samples of one prompt, as the next choices: the first computes the prompt and the others
        fork from it, sharing its KV blocks. Raises EngineDeadError if the engine has died."""
        streams = []
        for sample in params:
            request = self._engine.new_request(prompt_token_ids, sample, cache_salt, priority, self._lora_name)
            streams.append(Stream(request, self._mailbox, self._num_choices))
            self._num_choices += 1
        self._engine.submit(streams)
        self._open.update({s.index: s.request.request_id for s in streams})

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> tuple[int, RequestUpdate]:
        if not self._open:
            raise StopAsyncIteration
        item = await self._mailbox.queue.get()
        return take_update(item, self.close, lambda index: self._open.pop(index, None))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for request_id in self._open.values():
            self._engine.abort(request_id)
        self._open = {}

    def __del__(self) -> None:
        self.close()
