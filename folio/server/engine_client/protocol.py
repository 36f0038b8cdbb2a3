"""What the route handlers need from an engine, and nothing more.

`AsyncEngine` (the engine loop on a thread of this process) is one implementation; the Ray ingress's
`RemoteEngine` (folio/scale_out/remote_engine.py), which routes each prompt to one of several engine
replicas, is the other. Handlers never learn which one they talk to.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from folio.lora.adapter import LoRARequest
from folio.sampling_params import SamplingParams
from folio.server.engine_client.updates import RequestUpdate


class GenerationStream(Protocol):
    """The engine requests behind one API call, numbered as its choices (see generation.py)."""

    def add(
        self, prompt_token_ids: list[int], params: list[SamplingParams], cache_salt: str | None = None,
        priority: int = 0,
    ) -> None: ...  # fmt: skip

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestUpdate]]: ...

    def close(self) -> None: ...


class EngineClient(Protocol):
    @property
    def is_alive(self) -> bool: ...

    @property
    def max_model_len(self) -> int: ...

    def generation(self, lora_name: str | None = None) -> GenerationStream:
        """A new API call's requests, all run with the named LoRA adapter (None: the base model)."""
        ...

    async def add_lora(self, request: LoRARequest) -> None:
        """Register (or replace) a LoRA adapter that generations may then name; ValueError if the engine
        cannot serve it."""
        ...

    async def remove_lora(self, name: str) -> bool:
        """Whether the adapter was there; ValueError while requests still run with it."""
        ...
