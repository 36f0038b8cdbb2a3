"""The messages between the API server and an engine running in a process of its own.

Each is a small dataclass, pickled onto a ZeroMQ socket (as vLLM's EngineCore client falls back to
pickle for what msgpack cannot carry: here, sampling parameters, exceptions and embedding tensors).
Both sockets are IPC sockets in a directory only this user can enter, and both ends are this program.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from folio.engine.engine_core import EngineCore
from folio.engine.request import Request
from folio.engine_args import EngineArgs
from folio.loaders.tokenizer import Tokenizer
from folio.lora.adapter import LoRARequest
from folio.server.engine_client.updates import Update
from folio.server.model_card import ModelCard


@dataclass
class EngineInfo:
    """What the API side needs from the loaded model: sent once, when the engine is ready."""

    tokenizer: Tokenizer | None  # None where the API side said it had it (Load.send_tokenizer)
    eos_token_ids: frozenset[int]
    vocab_size: int
    hidden_size: int
    max_model_len: int
    max_num_seqs: int
    kv_capacity_tokens: int
    dtype: str
    model_card: ModelCard

    @classmethod
    def of(cls, engine: EngineCore, model_name: str, with_tokenizer: bool = True) -> EngineInfo:
        config, loaded = engine.model_config, engine.loaded
        assert loaded is not None, "an engine from EngineCore.from_engine_args"
        return cls(
            tokenizer=engine.tokenizer if with_tokenizer else None,
            eos_token_ids=frozenset(config.eos_token_ids),
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            max_model_len=engine.max_model_len,
            max_num_seqs=engine.scheduler_config.max_num_seqs,
            kv_capacity_tokens=engine.make_stats().kv_capacity_tokens,
            dtype=str(engine.dtype).removeprefix("torch."),
            model_card=ModelCard.describe(
                model_name,
                loaded.path,
                config,
                loaded.quantization,
                engine.max_model_len,
                loaded.weight_bytes + engine.kv_cache_bytes,
            ),
        )


# -- API server -> engine -------------------------------------------------------------------------------
@dataclass
class Load:
    """The model a started engine process loads (its first message); answered by Ready or StartFailed."""

    args: EngineArgs
    model_name: str
    send_tokenizer: bool = True  # False: the API side has this model's tokenizer from an earlier load


@dataclass
class Submit:
    """One prompt's samples (the first computes the prompt, the rest fork from it), for one API call."""

    mailbox: int  # the call's number: its updates come back under it
    requests: list[Request]
    first_index: int  # the choice the first request answers; the rest follow


@dataclass
class Abort:
    request_id: str


@dataclass
class MetricsQuery:
    query: int


@dataclass
class AdapterChange:
    """Register (or replace) a LoRA adapter, or remove one by name: answered by AdapterChanged."""

    query: int
    add: LoRARequest | None = None
    remove: str | None = None


@dataclass
class Shutdown:
    pass


# -- engine -> API server -------------------------------------------------------------------------------
@dataclass
class Ready:
    info: EngineInfo


@dataclass
class StartFailed:
    reason: str  # one line, for the command line


@dataclass
class Updates:
    """What one round of the engine loop posted: (call's mailbox, item) in the order posted."""

    items: list[tuple[int, Update]]


@dataclass
class MetricsText:
    query: int
    text: str  # the engine's registry in Prometheus' text format


@dataclass
class AdapterChanged:
    query: int
    removed: bool = False  # a removal found the adapter
    error: str | None = None  # why the change was not made
    refused: bool = True  # the adapter cannot be served (a ValueError), rather than a failure of the engine


@dataclass
class Died:
    reason: str


def encode(message: object) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> object:
    return pickle.loads(data)  # our own process, on a socket only this user can reach
