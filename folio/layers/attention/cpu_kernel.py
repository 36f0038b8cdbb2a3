"""A compiled CPU kernel for decode attention, built on first use with torch's C++ extension loader.

Decodes dominate long generations, and the pure-PyTorch path gathers every sequence's whole context
into a padded tensor per layer. The kernel reads K/V in place through the block tables instead.
If no compiler is available the engine keeps the pure-PyTorch path (which is also the kernel's oracle).
"""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("folio")

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"


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
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, or a build error: fall back, and say so once
        logger.warning("CPU decode-attention kernel unavailable (%s); using the PyTorch path", str(exc).splitlines()[0])
        return None
