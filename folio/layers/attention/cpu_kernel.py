"""A compiled CPU kernel for decode attention, built on first use with torch's C++ extension loader.

Decodes dominate long generations, and the pure-PyTorch path gathers every sequence's whole context
into a padded tensor per layer. The kernel reads K/V in place through the block tables instead.
If no compiler is available the engine keeps the pure-PyTorch path (which is also the kernel's oracle).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("folio")

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
# torch's build lock has no owner: a build killed midway leaves it behind and every later build
# waits on it forever. A real build takes under a minute, so an older lock is stale.
_STALE_LOCK_SECONDS = 300


def _build_directory() -> Path:
    """One directory per kernel source + flags + torch version, so different checkouts never rebuild
    each other's kernel."""
    from folio.loaders.catalog import folio_home

    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_CFLAGS).encode() + torch.__version__.encode())
    directory = folio_home() / "kernels" / f"paged_decode-{key.hexdigest()[:16]}"
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_SECONDS:
        logger.warning("removing a stale kernel build lock left by an interrupted build: %s", lock)
        lock.unlink(missing_ok=True)
    return directory


@cache
def load_decode_kernel() -> ModuleType | None:
    """The compiled module, or None when disabled (FOLIO_ATTENTION=torch) or it cannot be built."""
    if os.environ.get("FOLIO_ATTENTION", "auto") == "torch":
        return None
    try:
        from torch.utils.cpp_extension import load

        return load(
            name="folio_paged_decode",
            sources=[str(_SOURCE)],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(_build_directory()),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, or a build error: fall back, and say so once
        logger.warning("CPU decode-attention kernel unavailable (%s); using the PyTorch path", str(exc).splitlines()[0])
        return None
