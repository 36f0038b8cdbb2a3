"""A compiled CPU kernel for decode attention, built on first use with torch's C++ extension loader.

Decodes dominate long generations, and the pure-PyTorch path gathers every sequence's whole context
into a padded tensor per layer. The kernel reads K/V in place through the block tables instead.
If no compiler is available the engine keeps the pure-PyTorch path (which is also the kernel's oracle).
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from types import ModuleType

from folio.cpp_extension import load_extension

_SOURCE = Path(__file__).parents[2] / "csrc" / "paged_decode.cpp"


@cache
def load_decode_kernel() -> ModuleType | None:
    """The compiled module, or None when disabled (FOLIO_ATTENTION=torch) or it cannot be built."""
    if os.environ.get("FOLIO_ATTENTION", "auto") == "torch":
        return None
    fallback = "decode attention gathers each sequence's K/V cache in PyTorch instead (slower on long contexts)"
    return load_extension("paged_decode", "folio_paged_decode", _SOURCE, "decode-attention kernel", fallback)
