"""What a many-model server can serve, by the name a request gives as its `model`.

Three ways to say it, as llama-server's router mode and Ollama do: models named on the command line
(catalog names, .gguf files, Hugging Face folders, or `name=path` for a name of one's own), a folder
whose .gguf files and model folders are each a model (`--models-dir`, rescanned at each lookup, so a
file copied in is served without a restart), or nothing: every model pulled into folio's home.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from folio.loaders.catalog import CATALOG, list_pulled

LATEST = ":latest"  # Ollama's default tag: a name answers with or without it


@dataclass(frozen=True)
class ModelSource:
    name: str  # what requests call it
    spec: str  # what the engine loads: a catalog name, a .gguf file or a model folder
    origin: str  # "argument", "models_dir" or "pulled"

    def local_path(self) -> Path | None:
        """Where its file or folder is, if it is on this machine already (a catalog model once pulled)."""
        if self.spec in CATALOG:
            return next((m.path for m in list_pulled() if m.name == self.spec), None)
        if self.spec.startswith("hf:"):
            return None
        path = Path(self.spec).expanduser()
        return path if path.exists() else None


def name_of(spec: str) -> str:
    """The name a model is served under when no alias is given: a catalog name as it is, a file's stem,
    a folder's name, an `hf:org/repo`'s repo."""
    if spec in CATALOG:
        return spec
    if spec.startswith("hf:"):
        return spec.rsplit("/", 1)[-1]
    path = Path(spec).expanduser()
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def parse_spec(text: str) -> ModelSource:
    """`name=path` or a bare spec. A path may itself hold '=': only a name before the first '=' without a
    path separator counts as an alias."""
    name, sep, rest = text.partition("=")
    if sep and name and rest and os.sep not in name:
        return ModelSource(name, rest, "argument")
    return ModelSource(name_of(text), text, "argument")


def scan_folder(folder: Path) -> list[ModelSource]:
    """A folder's models: each .gguf file, each folder with config.json, and each folder holding
    exactly one .gguf file (llama-server's layout for a model with companion files), sorted by name."""
    found = []
    for entry in sorted(folder.iterdir()) if folder.is_dir() else ():
        if entry.name.startswith("."):
            continue
        if entry.is_file() and entry.suffix.lower() == ".gguf":
            found.append(ModelSource(entry.stem, str(entry), "models_dir"))
        elif entry.is_dir() and (entry / "config.json").is_file():
            found.append(ModelSource(entry.name, str(entry), "models_dir"))
        elif entry.is_dir() and len(ggufs := sorted(entry.glob("*.gguf"))) == 1:
            found.append(ModelSource(entry.name, str(ggufs[0]), "models_dir"))
    return found


class ModelSources:
    def __init__(self, specs: list[str], models_dir: Path | None = None) -> None:
        self.named = [parse_spec(spec) for spec in specs]
        names = [source.name for source in self.named]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"two models would be served as {', '.join(twice)}: give one an alias (name=path)")
        self.models_dir = models_dir
        if models_dir is not None and not models_dir.is_dir():
            raise ValueError(f"--models-dir {models_dir}: no such folder")

    @property
    def serves_pulled(self) -> bool:
        """No model named and no folder given: every pulled model, as `ollama serve` and llama-server do."""
        return not self.named and self.models_dir is None

    def available(self) -> dict[str, ModelSource]:
        """Every servable model by name, read now (the folder and folio's home may have changed). A name on
        the command line wins over a file of the same name in the folder."""
        found: list[ModelSource] = []
        if self.models_dir is not None:
            found += scan_folder(self.models_dir)
        if self.serves_pulled:
            found += [ModelSource(m.name, m.name, "pulled") for m in list_pulled()]
        by_name = {source.name: source for source in found}
        by_name.update((source.name, source) for source in self.named)
        return by_name

    def find(self, name: str) -> ModelSource | None:
        available = self.available()
        return available.get(name) or available.get(name.removesuffix(LATEST))
