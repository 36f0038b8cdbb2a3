"""Where folio keeps its files on this machine (pulled models, tokenizers, compiled kernels), and writes
that appear whole or not at all.

A leaf module: the kernel builder and the model loaders both need it, and neither may import the other.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def folio_home() -> Path:
    """Where folio keeps pulled models and caches: $FOLIO_HOME, else ~/.cache/folio."""
    env = os.environ.get("FOLIO_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "folio"


@contextmanager
def atomic_open(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """A file (text or "wb") that appears at `path` whole when the block ends, or not at all."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes files private; results are for everyone to read
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
