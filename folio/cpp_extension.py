"""Builds folio's small C++ CPU kernels on first use with torch's extension loader, each in its own
directory under $FOLIO_HOME/kernels keyed by source, flags and torch version. A kernel that cannot be
built (no compiler, no ninja) is None, and its caller keeps a pure-PyTorch path."""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("folio")

CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
# torch's build lock has no owner: a build killed midway leaves it behind and every later build
# waits on it forever. A real build takes under a minute, so an older lock is stale.
STALE_LOCK_SECONDS = 300


def build_directory(name: str, source: Path) -> Path:
    """One directory per kernel source (and the headers beside it) + flags + torch version, so
    different checkouts never rebuild each other's kernel."""
    from folio.loaders.catalog import folio_home

    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what it may include
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(CFLAGS).encode() + torch.__version__.encode())
    directory = folio_home() / "kernels" / f"{name}-{key.hexdigest()[:16]}"
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
        logger.warning("removing a stale kernel build lock left by an interrupted build: %s", lock)
        lock.unlink(missing_ok=True)
    return directory


def load_extension(name: str, module_name: str, source: Path, what: str) -> ModuleType | None:
    """The compiled module, or None (logged once, naming `what` falls back) if it cannot be built."""
    try:
        from torch.utils.cpp_extension import load

        return load(
            name=module_name,
            sources=[str(source)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_directory(name, source)),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, or a build error: fall back, and say so once
        logger.warning("%s kernel unavailable (%s); using the PyTorch path", what, str(exc).splitlines()[0])
        return None
