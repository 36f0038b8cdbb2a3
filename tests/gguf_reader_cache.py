"""A faster `gguf.GGUFReader` for the oracles' transformers side (test-only).

transformers reads a GGUF file through `gguf.GGUFReader`, which slices one numpy view per element of
every array field. On an `np.memmap` each slice runs memmap's Python-level `__array_finalize__`: Gemma
3's 262k-token vocabulary alone then takes ~50 s on this machine, and transformers parses the file
twice per model (once for the config, once for the weights), again for its tokenizer. Here the reader
slices a plain ndarray over the same mapped bytes (the same values, without the Python hook), and one
parsed reader per file is kept for the session's later loads. Nothing in folio uses GGUFReader
(folio/loaders/gguf_file.py reads GGUF itself), so only the reference side is touched.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import gguf
import numpy as np
from gguf import gguf_reader

_REAL_READER = gguf_reader.GGUFReader


class _NumpyWithPlainMaps:
    """numpy, except that `memmap` gives a plain ndarray view of the map (the map stays open under it)."""

    def __getattr__(self, name: str):
        return getattr(np, name)

    @staticmethod
    def memmap(*args, **kwargs) -> np.ndarray:
        return np.memmap(*args, **kwargs).view(np.ndarray)


@functools.lru_cache(maxsize=4)
def _parsed(path: str, mode: str, _identity: tuple[int, int, int]) -> gguf_reader.GGUFReader:
    return _REAL_READER(path, mode)


def _cached_reader(path: os.PathLike[str] | str, mode: str = "r") -> gguf_reader.GGUFReader:
    if mode != "r":  # a writable map must be the caller's own
        return _REAL_READER(path, mode)
    stat = Path(path).stat()
    # A file rewritten in place (a test's tmp model) is a different file: its size, time or inode differ.
    return _parsed(str(Path(path).resolve()), mode, (stat.st_ino, stat.st_size, stat.st_mtime_ns))


def install() -> None:
    gguf_reader.np = _NumpyWithPlainMaps()
    gguf.GGUFReader = _cached_reader  # transformers imports it from `gguf` at each load
