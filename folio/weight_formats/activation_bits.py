"""How many bits of each activation the int8 dot-product kernels multiply (folio/csrc/int8_activations.h).

16 (the default): an 8-bit code and the 8-bit code of its rounding error, so kept-quantized weights
give what their widened weights give, within the oracle tests' bounds. 8: the code alone, as llama.cpp
quantizes activations to Q8 for its dot products: half the integer products, which is what many rows
(batched decode, prefill) pay for, and next-token distributions measurably further from float32's
(docs/benchmarks.md), hence not the default.
"""

from __future__ import annotations

from torch import nn

from folio.config import ACTIVATION_BITS_CHOICES
from folio.weight_formats.int4 import PackedInt4
from folio.weight_formats.int8 import PackedInt8


def set_activation_bits(model: nn.Module, bits: int) -> int:
    """Set every kept-quantized weight of `model` to take `bits`-bit activations; returns how many. Call
    before the engine is built: the C++ decode step copies the setting when it is."""
    if bits not in ACTIVATION_BITS_CHOICES:
        raise ValueError(f"activation bits must be one of {ACTIVATION_BITS_CHOICES}, got {bits}")
    count = 0
    for module in model.modules():
        packed = getattr(module, "packed", None)
        for kernel in getattr(packed, "parts", [packed]):  # a weight in row blocks (ConcatRows): each block's
            if isinstance(kernel, PackedInt4 | PackedInt8):
                kernel.exact_activations = bits == 16
                count += 1
    return count
