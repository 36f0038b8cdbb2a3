"""How a Linear layer holds its weight: dense, or 4-bit packed (folio/quant/int4.py).

A fused layer (q|k|v, gate|up) receives its shards one at a time. 4-bit shards are staged as codes
(a byte per weight, for this layer only) and packed once every row has arrived, so no dense copy of
the weight ever exists. If a fused layer gets shards of mixed kinds (e.g. a 4-bit q and a 5-bit k
in one GGUF file), it falls back to dense for the whole layer.
"""

from __future__ import annotations

import torch

from folio.quant.int4 import GROUP_SIZE, Int4Groups, PackedInt4


class Int4Staging:
    """Rows of a [N, K] weight arriving as Int4Groups, until all N are in."""

    def __init__(self, rows: int, cols: int) -> None:
        self.groups = Int4Groups(
            torch.zeros(rows, cols, dtype=torch.uint8),
            torch.zeros(rows, cols // GROUP_SIZE),
            torch.zeros(rows, cols // GROUP_SIZE),
        )
        self.filled = torch.zeros(rows, dtype=torch.bool)

    def put(self, offset: int, part: Int4Groups) -> None:
        size = part.shape[0]
        self.groups.codes[offset : offset + size] = part.codes
        self.groups.scales[offset : offset + size] = part.scales
        self.groups.zeros[offset : offset + size] = part.zeros
        self.filled[offset : offset + size] = True

    @property
    def complete(self) -> bool:
        return bool(self.filled.all())

    def dense_rows(self, dtype: torch.dtype) -> list[tuple[int, torch.Tensor]]:
        """The rows staged so far, dequantized, as (offset, rows) runs: for the fall back to dense."""
        runs, start = [], None
        filled = self.filled.tolist() + [False]
        for row, is_filled in enumerate(filled):
            if is_filled and start is None:
                start = row
            elif not is_filled and start is not None:
                part = Int4Groups(self.groups.codes[start:row], self.groups.scales[start:row],
                                  self.groups.zeros[start:row])  # fmt: skip
                runs.append((start, part.dequantize(dtype)))
                start = None
        return runs


def can_pack(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> bool:
    """The CPU int4 kernel needs whole 64-row blocks; the model must compute in float32 or bfloat16."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and rows % 64 == 0
        and (cols % GROUP_SIZE == 0)
    )


def pack(staging: Int4Staging) -> PackedInt4:
    return PackedInt4(staging.groups)
