"""What an architecture declares about itself, and every architecture folio runs.

A model module declares `ARCHITECTURES`, a tuple of `Architecture`; adding a file that does is all it takes
for the loaders, `folio quantize` and `folio kv-calc` to know the model (they read everything
architecture-specific from here): how config.json and GGUF metadata become a `ModelConfig` (and a
`ModelConfig` becomes config.json again), how checkpoint tensor names map onto the model's parameters,
which checkpoint tensors fuse into one layer, the GGUF vocabulary's family, and whether the C++ decode
step (decode_stack.py) serves the model.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Protocol

from folio.config import ModelConfig
from folio.models.base import CausalLM

HFConfig = dict[str, Any]  # a parsed config.json


class GGUFMetadata(Protocol):
    """What an architecture reads from a GGUF file (loaders/gguf_file.py's GGUFFile is one)."""

    tensors: Mapping[str, Any]

    @property
    def architecture(self) -> str: ...

    def get(self, key: str, default: Any = None) -> Any: ...

    def arch_get(self, key: str, default: Any = None) -> Any: ...


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp stores the architecture: metadata, tensor names, and the conversions its converter
    applied that folio undoes (tensors come out under their Hugging Face names and conventions)."""

    names: tuple[str, ...]  # `general.architecture` values, e.g. ("llama",)
    config_from_gguf: Callable[[GGUFMetadata], ModelConfig]
    block_names: Mapping[str, str]  # "attn_q" (in blk.N.attn_q.weight) -> "self_attn.q_proj"
    top_names: Mapping[str, str]  # "token_embd" -> "model.embed_tokens"
    layer_prefix: str = "model.layers"  # Hugging Face prefix of block N: "<prefix>.N.<block name>"
    permuted_rope_rows: bool = False  # q/k rows interleaved for GGML's RoPE (llama.cpp's Llama converter)
    norm_offset: float = 0.0  # added to every norm weight by the converter (Gemma's 1 + w)


@dataclass(frozen=True)
class Architecture:
    name: str  # short name, e.g. "llama"
    hf_names: tuple[str, ...]  # config.json "architectures" values it runs, e.g. ("LlamaForCausalLM",)
    model_class: type[CausalLM]
    config_from_hf: Callable[[HFConfig], ModelConfig]
    config_to_hf: Callable[[ModelConfig], HFConfig]  # config.json for a checkpoint folio writes
    gguf: GGUFLayout | None = None  # None: no GGUF support
    # The family of a GGUF SentencePiece vocabulary ("llama" or "gemma": loaders/gguf_tokenizer.py).
    tokenizer_family: str = "llama"
    # The C++ decode step (decode_stack.py) serves it: the model class overrides bind_decode_stack.
    decode_stack: bool = False
    # Parameter count from the config alone (`folio kv-calc` on a bare config.json); None: the
    # Llama layout's estimate (kv_calc.params_from_config).
    estimate_params: Callable[[ModelConfig], int] | None = None
    # config.json architecture names this module knows and refuses, with the reason shown to the user.
    hf_refused: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        binds = self.model_class.bind_decode_stack is not CausalLM.bind_decode_stack
        if binds != self.decode_stack:
            verb = "binds" if binds else "does not bind"
            raise ValueError(f"{self.name}: decode_stack={self.decode_stack} but its model class {verb} one")


@cache
def all_architectures() -> tuple[Architecture, ...]:
    package = importlib.import_module(__package__)
    found: list[Architecture] = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__package__}.{info.name}")
        found.extend(getattr(module, "ARCHITECTURES", ()))
    _check_unique([n for a in found for n in a.hf_names], "config.json architecture")
    _check_unique([n for a in found if a.gguf for n in a.gguf.names], "GGUF architecture")
    return tuple(found)


def _check_unique(names: list[str], what: str) -> None:
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise RuntimeError(f"{what} names declared by two model modules: {repeated}")


def architecture_named(hf_name: str) -> Architecture:
    """The architecture of a config.json "architectures" name (ModelConfig.architecture)."""
    for arch in all_architectures():
        if hf_name in arch.hf_names:
            return arch
    for arch in all_architectures():
        if hf_name in arch.hf_refused:
            raise ValueError(arch.hf_refused[hf_name])
    known = ", ".join(sorted(n for a in all_architectures() for n in a.hf_names))
    raise ValueError(f"architecture {hf_name!r} is not supported; folio runs {known}")


def architecture_of(config: ModelConfig) -> Architecture:
    return architecture_named(config.architecture)


def gguf_architecture(gguf_name: str) -> Architecture:
    """The architecture of a GGUF file's `general.architecture`."""
    for arch in all_architectures():
        if arch.gguf is not None and gguf_name in arch.gguf.names:
            return arch
    known = sorted(n for a in all_architectures() if a.gguf for n in a.gguf.names)
    raise ValueError(f"GGUF architecture {gguf_name!r} is not supported; folio runs {known}")


def config_from_hf(raw: HFConfig) -> ModelConfig:
    names = raw.get("architectures") or []
    if not names:
        raise ValueError("config.json names no architecture")
    return architecture_named(names[0]).config_from_hf(raw)


def model_class(config: ModelConfig) -> type[CausalLM]:
    return architecture_of(config).model_class
