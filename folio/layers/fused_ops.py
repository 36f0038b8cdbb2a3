"""Fused CPU ops for the small steps between matmuls (csrc/fused_ops.cpp): RMSNorm with its residual
add, rotary embedding in place, gated activations.

At batch-1 decode a layer's norms, rotary and activation are microseconds of arithmetic spread over
dozens of PyTorch ops, and dispatching those ops costs more than the 4-bit matmuls. The PyTorch
versions in norm.py, rotary.py and activation.py stay as the oracle and as the path on other devices,
without a compiler, or with FOLIO_FUSED_OPS=0.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from folio.cpp_extension import load_extension

_SOURCE = Path(__file__).parents[1] / "csrc" / "fused_ops.cpp"


@cache
def _load() -> ModuleType | None:
    if os.environ.get("FOLIO_FUSED_OPS", "1") == "0":
        return None
    fallback = "norms, rotary embeddings and activations run as separate PyTorch ops instead (slower decode)"
    return load_extension("fused_ops", "folio_fused_ops", _SOURCE, "fused norm/rotary/activation kernel", fallback)


def fused_ops_for(x: torch.Tensor) -> ModuleType | None:
    """The compiled ops if they can run on x (a CPU tensor of a floating dtype), else None."""
    if x.device.type != "cpu" or not x.is_floating_point():
        return None
    return _load()
