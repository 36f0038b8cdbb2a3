"""One rank's slice of a checkpoint tensor, in the form it arrived in.

Dense tensors are narrowed as views (the layer copies them into its own parameter). Row-separable
quantized weights (4-bit groups, 8-bit groups, per-channel int8) are narrowed in their own codes and
scales, copied so that the whole tensor can be freed: any rows, and columns on their group
boundaries, so a rank holds its shard quantized and never widens the whole weight. NF4's
double-quantized scales run across rows, so a slice of it is dequantized (see docs/parallelism.md).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from folio.weight_formats.int4 import Int4Groups
from folio.weight_formats.int8 import ChannelInt8, Int8Groups


@runtime_checkable
class LazyWeight(Protocol):
    """A checkpoint tensor not read yet (a GGUF tensor's memory-mapped blocks): a rank narrows it
    first and reads only its slice."""

    shape: tuple[int, ...]

    def narrow(self, dim: int, start: int, size: int) -> LazyWeight: ...

    def load(self) -> Any:
        """The slice as a dense tensor or quantized groups, as an eager loader would have given it."""


def narrow_weight(loaded: Any, dim: int, start: int, size: int) -> Any:
    """`loaded` restricted to [start, start + size) along `dim` (0: output rows, 1: input columns); a
    lazy weight is read now, only that slice of it."""
    if isinstance(loaded, LazyWeight):
        inside = dim < len(loaded.shape) and (start, size) != (0, loaded.shape[dim])
        return (loaded.narrow(dim, start, size) if inside else loaded).load()
    if dim >= len(loaded.shape):  # e.g. a bias of a row-parallel layer: not split
        return loaded
    if start == 0 and size == loaded.shape[dim]:
        return loaded
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    if isinstance(loaded, Int4Groups | Int8Groups):
        if dim == 0:
            return _with_fields(loaded, [t.narrow(0, start, size).clone() for t in _fields(loaded)])
        group = loaded.group_size
        if start % group or size % group:
            raise ValueError(
                f"a tensor-parallel split at columns [{start}, {start + size}) cuts this weight's quantization "
                f"groups of {group}"
            )
        codes, *scales = _fields(loaded)
        narrowed = [codes.narrow(1, start, size), *(s.narrow(1, start // group, size // group) for s in scales)]
        return _with_fields(loaded, [t.contiguous() for t in narrowed])
    if isinstance(loaded, ChannelInt8):
        scales = loaded.scales.float()
        codes = loaded.codes.narrow(dim, start, size).clone()
        return ChannelInt8(codes, scales.narrow(0, start, size) if dim == 0 else scales)
    return loaded.dequantize(torch.float32).narrow(dim, start, size)


def _fields(groups: Int4Groups | Int8Groups) -> list[torch.Tensor]:
    if isinstance(groups, Int4Groups):
        return [groups.codes, groups.scales, groups.zeros]
    return [groups.codes, groups.scales]


def _with_fields(groups: Int4Groups | Int8Groups, tensors: list[torch.Tensor]) -> Int4Groups | Int8Groups:
    """`groups` with its tensors (in `_fields` order) replaced; a 5-bit weight stays 5-bit."""
    if isinstance(groups, Int4Groups):
        return Int4Groups(*tensors, bits=groups.bits)
    return Int8Groups(*tensors)
