"""Models made on the server from others, as Ollama's `/api/create` and `/api/copy` make them: a base
model served here, optionally a LoRA adapter, and a preset (a system prompt, a chat template, default
options, a conversation's opening messages, a license). Nothing is copied but the adapter's files: the
base's weights stay where they are.

Each lives in a folder of its own under the server's created-models folder (folio's home): `model.json`
and, with an adapter, `adapter/` (PEFT's files). A server of several models lists them, loads their base
when a request names them, and keeps them across restarts.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from folio.paths import atomic_open

logger = logging.getLogger("folio")

RECORD = "model.json"
ADAPTER = "adapter"
# What a created model may be called: Ollama's names (namespace/name:tag), nothing that leaves the folder.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}(/[A-Za-z0-9][A-Za-z0-9._-]{0,79})?(:[A-Za-z0-9._-]{1,80})?")


@dataclass(frozen=True)
class ModelPreset:
    system: str | None = None  # the system prompt when a request gives none
    template: str | None = None  # a Jinja chat template in place of the model's own
    parameters: dict[str, Any] = field(default_factory=dict)  # Ollama options under each request's own
    messages: tuple[dict[str, str], ...] = ()  # the start of every conversation (Modelfile MESSAGE lines)
    license: str | None = None

    def merged_over(self, older: ModelPreset) -> ModelPreset:
        """This preset's settings, and the older one's where this one sets nothing."""
        return ModelPreset(
            system=self.system if self.system is not None else older.system,
            template=self.template if self.template is not None else older.template,
            parameters={**older.parameters, **self.parameters},
            messages=self.messages or older.messages,
            license=self.license if self.license is not None else older.license,
        )


@dataclass(frozen=True)
class CreatedModel:
    name: str
    base: str  # the served model it is made from (never another created model: those are flattened)
    preset: ModelPreset = field(default_factory=ModelPreset)
    adapter: str | None = None  # its LoRA adapter's PEFT folder


def folder_name(name: str) -> str:
    """A created model's folder: its name with the namespace's slash and the tag's colon made safe."""
    return name.replace("/", "--").replace(":", "--")


def check_name(name: str) -> None:
    if not NAME.fullmatch(name):
        raise ValueError(f"'{name}' is not a model name (letters, digits, '.', '_', '-'; namespace/name:tag)")


class CreatedModels:
    """The created models kept in `root` (read at start; written through as they change)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._models: dict[str, CreatedModel] = {}
        for record in sorted(root.glob(f"*/{RECORD}")) if root.is_dir() else ():
            try:
                model = _read(record)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("skipping the created model at %s: %s", record.parent, exc)
                continue
            self._models[model.name] = model

    def get(self, name: str | None) -> CreatedModel | None:
        return self._models.get(name) if name is not None else None

    def __iter__(self):
        return iter(list(self._models.values()))

    def folder(self, name: str) -> Path:
        return self.root / folder_name(name)

    def save(self, model: CreatedModel, adapter_files: dict[str, Path] | None = None) -> CreatedModel:
        """Write the model's record (and copy its adapter's files into its own folder); replaces a created
        model of that name. Returns the model as kept (its adapter in its folder)."""
        check_name(model.name)
        folder = self.folder(model.name)
        folder.mkdir(parents=True, exist_ok=True)
        if adapter_files:
            adapter = folder / ADAPTER
            shutil.rmtree(adapter, ignore_errors=True)
            adapter.mkdir()
            for filename, source in adapter_files.items():
                shutil.copyfile(source, adapter / filename)
            model = CreatedModel(model.name, model.base, model.preset, str(adapter))
        record = asdict(model)
        with atomic_open(folder / RECORD) as f:
            json.dump(record, f, indent=1, ensure_ascii=False)
        self._models[model.name] = model
        return model

    def forget(self, name: str) -> None:
        """Stop serving it, leaving its files (its base is not served by this server)."""
        self._models.pop(name, None)

    def remove(self, name: str) -> bool:
        if self._models.pop(name, None) is None:
            return False
        shutil.rmtree(self.folder(name), ignore_errors=True)
        return True


def _read(record: Path) -> CreatedModel:
    data = json.loads(record.read_text())
    preset = data.get("preset") or {}
    messages = tuple(dict(m) for m in preset.get("messages") or ())
    return CreatedModel(
        name=str(data["name"]),
        base=str(data["base"]),
        preset=ModelPreset(
            preset.get("system"),
            preset.get("template"),
            dict(preset.get("parameters") or {}),
            messages,
            preset.get("license"),
        ),  # fmt: skip
        adapter=data.get("adapter"),
    )
