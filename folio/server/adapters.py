"""The LoRA adapters a server serves by name, each on its base model: vLLM's `--lora-modules` entries
(`NAME=PATH`, or its JSON form `{"name", "path", "base_model_name"}`) and those loaded at run time
through /v1/load_lora_adapter. A request names an adapter as its `model`; the adapter's base model
serves it, in the same engine and batches as the base's own requests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from folio.lora.adapter import LoRARequest
from folio.server.errors import APIError
from folio.server.model_sources import LATEST

RUNTIME_OFF = (
    "loading and unloading LoRA adapters at run time is off: start the server with --runtime-lora (it reads "
    "the adapter folders requests name on this machine)"
)


@dataclass(frozen=True)
class LoRAModule:
    name: str  # what requests call it
    path: str  # its PEFT folder
    base_model_name: str | None = None  # the served model it adapts; None: the server's only model

    @property
    def request(self) -> LoRARequest:
        return LoRARequest(self.name, self.path)

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        """One --lora-modules entry: NAME=PATH, or vLLM's JSON object with name, path and base_model_name."""
        if not text.lstrip().startswith("{"):
            name, sep, path = text.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules takes NAME=PATH (a PEFT adapter folder) or a JSON object, "
                                 f"got {text!r}")  # fmt: skip
            return cls(name, path)
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON ({exc.msg})") from None
        if not isinstance(entry, dict) or set(entry) - {"name", "path", "base_model_name"}:
            raise ValueError(f'--lora-modules JSON takes "name", "path" and "base_model_name", got {text!r}')
        name, path, base = entry.get("name"), entry.get("path"), entry.get("base_model_name")
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            raise ValueError(f'--lora-modules JSON needs "name" and "path" strings, got {text!r}')
        if base is not None and not (isinstance(base, str) and base):
            raise ValueError(f'--lora-modules: "base_model_name" must name a served model, got {base!r}')
        return cls(name, path, base)


class AdapterTable:
    """The adapters by name (Ollama's ":latest" suffix accepted), and whether requests may change them."""

    def __init__(self, modules: list[LoRAModule], runtime: bool) -> None:
        self.runtime = runtime
        self._modules: dict[str, LoRAModule] = {}
        for module in modules:
            if module.name in self._modules:
                raise ValueError(f"two LoRA adapters are named {module.name!r}")
            self._modules[module.name] = module

    def get(self, name: str | None) -> LoRAModule | None:
        if name is None:
            return None
        return self._modules.get(name) or self._modules.get(name.removesuffix(LATEST))

    def on(self, base: str) -> list[LoRAModule]:
        return [module for module in self._modules.values() if module.base_model_name == base]

    def __iter__(self) -> Iterator[LoRAModule]:
        return iter(list(self._modules.values()))

    def require_runtime(self) -> None:
        if not self.runtime:
            raise APIError(400, RUNTIME_OFF)

    def add(self, module: LoRAModule) -> None:
        self._modules[module.name] = module

    def remove(self, name: str) -> None:
        self._modules.pop(name, None)

    def known(self, name: str) -> LoRAModule:
        """The adapter, or vLLM's 404 for an unload of one that is not there."""
        module = self.get(name)
        if module is None:
            raise APIError(404, f"no LoRA adapter named '{name}' is loaded", param="lora_name",
                           code="model_not_found")  # fmt: skip
        return module
