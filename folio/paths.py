"""Where folio keeps its files on this machine (pulled models, tokenizers, compiled kernels).

A leaf module: the kernel builder and the model loaders both need it, and neither may import the other.
"""

from __future__ import annotations

import os
from pathlib import Path


def folio_home() -> Path:
    """Where folio keeps pulled models and caches: $FOLIO_HOME, else ~/.cache/folio."""
    env = os.environ.get("FOLIO_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "folio"
