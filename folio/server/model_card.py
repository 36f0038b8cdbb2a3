"""What the model-listing routes (Ollama's /api/tags, /api/show, /api/ps) say about the served model:
read once from its file at start-up, except its digest, which ollama/routes.py hashes once, off the event
loop, on first use (seconds for a file of several GB)."""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from safetensors import safe_open

from folio.config import ModelConfig
from folio.loaders.gguf_file import GGUFFile
from folio.loaders.gguf_model import gguf_model_config
from folio.loaders.hf_folder import read_hf_config, read_quantization_config
from folio.models.registry import architecture_of


def _parameter_count(path: Path) -> int:
    """Exact, from the file's tensor headers (no weight is read)."""
    if path.suffix == ".gguf":
        return sum(t.num_elements for t in GGUFFile(path).tensors.values())
    total = 0
    for file in sorted((path if path.is_dir() else path.parent).glob("*.safetensors")):
        with safe_open(str(file), "pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (safe_open is not a mapping)
                total += math.prod(tensors.get_slice(name).get_shape())
    return total


def _bytes_on_disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) if path.is_dir() else path.stat().st_size


def size_label(count: int) -> str:
    """Ollama's parameter_size: "134.52M", "3.2B"."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f}".rstrip("0").rstrip(".") + unit
    return str(count)


def iso_time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


@dataclass
class ModelCard:
    name: str
    path: Path
    family: str  # e.g. "llama", "gemma3"
    quantization: str  # e.g. "Q4_1", "none"
    parameter_count: int
    context_length: int
    embedding_length: int
    size_bytes: int  # on disk
    modified_at: str  # the file's modification time, ISO 8601 (read once: the file may go while serving)
    resident_bytes: int | None = None  # weights and KV cache held in memory, where known
    loaded_at: float = field(default_factory=time.time)

    @classmethod
    def describe(
        cls, name: str, path: Path, config: ModelConfig, quantization: str, context_length: int,
        resident_bytes: int | None = None,
    ) -> ModelCard:  # fmt: skip
        return cls(
            name=name,
            path=path,
            family=architecture_of(config).name,
            quantization=quantization,
            parameter_count=_parameter_count(path),
            context_length=context_length,
            embedding_length=config.hidden_size,
            size_bytes=_bytes_on_disk(path),
            modified_at=iso_time(path.stat().st_mtime),
            resident_bytes=resident_bytes,
        )

    @classmethod
    def read(cls, name: str, path: Path) -> ModelCard:
        """A model not loaded, from its file's headers and config (no weight is read; a GGUF file's header
        takes a moment to parse: call it off the event loop)."""
        if path.is_file():
            gguf = GGUFFile(path)
            config, quantization = gguf_model_config(gguf), gguf.quantization_summary()
        else:
            config = read_hf_config(path)
            checkpoint_quant = read_quantization_config(path)
            quantization = "none" if checkpoint_quant is None else checkpoint_quant.label
        card = cls.describe(name, path, config, quantization, config.max_position_embeddings)
        card.loaded_at = 0.0  # not loaded
        return card

    @property
    def format(self) -> str:
        return "gguf" if self.path.suffix == ".gguf" else "safetensors"

    def compute_digest(self) -> str:
        """sha256 of the model file (of config.json for a folder), as Ollama identifies a model. It reads
        the whole file: call it off the event loop, once. OSError if the file is gone."""
        target = self.path / "config.json" if self.path.is_dir() else self.path
        with target.open("rb") as file:
            return hashlib.file_digest(file, "sha256").hexdigest()

    def details(self) -> dict:
        return {
            "parent_model": "",
            "format": self.format,
            "family": self.family,
            "families": [self.family],
            "parameter_size": size_label(self.parameter_count),
            "quantization_level": self.quantization,
        }
