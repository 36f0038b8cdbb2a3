"""Fused CPU ops for the small steps between matmuls (folio/csrc/fused_ops.cpp): RMSNorm with its residual
add, rotary embedding in place, gated activations.

At batch-1 decode a layer's norms, rotary and activation are microseconds of arithmetic spread over
dozens of PyTorch ops, and dispatching those ops costs more than the 4-bit matmuls. The PyTorch
versions in norm.py, rotary.py and activation.py stay as the oracle and as the path on other devices,
without a compiler, or with FOLIO_DISABLE_KERNELS=fused_ops (folio/ops.py).
"""

from __future__ import annotations

from types import ModuleType

import torch

from folio import ops


def fused_ops_for(x: torch.Tensor) -> ModuleType | None:
    """The compiled ops if they can run on x (a CPU tensor of a floating dtype), else None."""
    if x.device.type != "cpu" or not x.is_floating_point():
        return None
    return ops.load("fused_ops")
