"""Every architecture folio runs, collected from the model modules of this package.

A model module declares `ARCHITECTURES`, a tuple of `Architecture` (architecture.py); adding a file
that does is all it takes for the loaders, `folio quantize` and `folio kv-calc` to know the model.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from folio.config import ModelConfig
from folio.models.architecture import Architecture, HFConfig
from folio.models.base import CausalLM


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
