"""The many-model server's accounting: its limits, each loaded model's record (leases, idle time, bytes
held), and the arithmetic of what a model will hold before it loads (model_manager.py decides with it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from folio.config import parse_memory
from folio.engine_args import EngineArgs
from folio.platform import default_device, default_kv_cache_memory
from folio.server.context import ServerContext
from folio.server.engine_client.process import ProcessEngine
from folio.server.engine_client.wire import EngineInfo
from folio.server.model_sources import ModelSource


@dataclass(frozen=True)
class ManagerOptions:
    max_loaded: int = 3  # Ollama's default on a machine without a GPU
    keep_alive: float | None = 300.0  # seconds an idle model stays loaded; None: for good (Ollama's 5 minutes)
    memory_budget: int | None = None  # bytes the loaded models' weights and KV caches may hold; None: no bound
    room_timeout: float = 300.0  # seconds a request waits for a busy model to free its place
    max_waiting: int = 64  # requests waiting for room at once; more get 429
    spare_engine: bool = True  # keep an engine process started ahead (engine_starts.py)

    def __post_init__(self) -> None:
        if self.max_loaded < 1:
            raise ValueError(f"--max-loaded-models must be >= 1, got {self.max_loaded}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"the models' memory budget must be > 0 bytes, got {self.memory_budget}")
        if self.room_timeout < 0 or self.max_waiting < 0:
            raise ValueError("the wait for a loaded model's place must be >= 0 seconds and >= 0 requests")


MakeContext = Callable[[ProcessEngine, EngineInfo, str], ServerContext]


@dataclass(eq=False)  # each load is its own: compared and hashed by identity
class LoadedModel:
    source: ModelSource
    engine: ProcessEngine
    context: ServerContext
    keep_alive: float | None
    estimate: int  # bytes it was expected to hold before it loaded
    lora: bool = False  # loaded with LoRA slots (adapters can be registered in its engine)
    last_used: float = field(default_factory=time.monotonic)
    leases: int = 0  # routes holding it now

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def idle(self) -> bool:
        return self.leases == 0 and self.context.admission.in_flight == 0

    @property
    def resident_bytes(self) -> int:
        """Its weights and KV cache, as the engine reported them once loaded."""
        card = self.context.model_card
        return card.resident_bytes if card is not None and card.resident_bytes is not None else self.estimate

    def expires_at(self) -> float | None:
        """Monotonic time at which it is unloaded if it stays idle; None: never."""
        return None if self.keep_alive is None else self.last_used + self.keep_alive


def estimate_bytes(source: ModelSource, args: EngineArgs) -> int:
    """What a model will hold before it loads: its weights as stored (a pulled or local file; 0 for one
    still to download) and the KV cache its flags ask for (the engine's default share of free memory
    where none is given; a pool given in blocks counts once loaded), and its host-RAM KV tier."""
    path = source.local_path()
    held = parse_memory(args.kv_offload_ram) or 0
    if path is not None:
        files = [f for f in path.iterdir() if f.is_file()] if path.is_dir() else [path]
        held += sum(f.stat().st_size for f in files)
    if args.num_kv_blocks is not None:
        return held
    kv = parse_memory(args.kv_cache_memory)
    device = torch.device(args.device) if args.device else default_device()
    return held + (kv if kv is not None else default_kv_cache_memory(device))


def engine_args_for(source: ModelSource, base_args: EngineArgs, options: ManagerOptions, lora: bool) -> EngineArgs:
    """The server's flags for this model (with LoRA slots if it serves adapters). A KV pool left to its
    default gets at most a share of the budget (half of it over --max-loaded-models), not the default
    share of free memory each: models loaded later would find that memory taken."""
    args = replace(base_args, model=source.spec, enable_lora=base_args.enable_lora or lora)
    budget = options.memory_budget
    if budget is None or args.kv_cache_memory is not None or args.num_kv_blocks is not None:
        return args
    device = torch.device(args.device) if args.device else default_device()
    return replace(args, kv_cache_memory=min(default_kv_cache_memory(device), budget // (2 * options.max_loaded)))
