"""Linear layers that own their weight loading.

Each parameter carries a `weight_loader(param, loaded, shard_id)` so checkpoints with separate
q/k/v or gate/up tensors load into fused layers, whatever the file format. The weight is dense, or,
when the checkpoint gives it quantized (4-bit groups from GGUF/GPTQ/AWQ, int8, NF4) and the device
has a kernel for the format, kept quantized (see weight_storage.py); `forward` hides which.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from folio.layers.lora import LoRASlots
from folio.layers.weight_storage import QuantizedKernel, RowQuantized, RowStaging, can_keep, can_pack
from folio.weight_formats.int4 import GROUP_SIZE, PackedInt4, rtn_groups
from folio.weight_formats.int8 import ChannelInt8
from folio.weight_formats.nf4 import BLOCK_SIZE as NF4_BLOCK
from folio.weight_formats.nf4 import NF4Weight

ON_THE_FLY_METHODS = ("int8", "int4", "nf4")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.bias = None
        self.packed: QuantizedKernel | None = None  # set once a quantized weight is complete
        self.lora: LoRASlots | None = None  # adapters' weights, once one targets this layer (lora/store.py)
        self._staging: RowStaging | None = None
        self._has_dense_rows = False

    def shard_rows(self, shard_id: object) -> tuple[int, int]:
        """(first output row, number of rows) a checkpoint tensor fills."""
        return 0, self.out_features

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | RowQuantized, shard_id: object = None) -> None:
        offset, size = self.shard_rows(shard_id)
        if param is not self.weight:  # a bias: always dense
            _copy_rows(param.data, offset, size, loaded, shard_id)
        elif isinstance(loaded, torch.Tensor):
            self._to_dense()
            _copy_rows(param.data, offset, size, loaded, shard_id)
            self._has_dense_rows = True
        else:
            self._load_quantized(offset, size, loaded, shard_id)

    def _load_quantized(self, offset: int, size: int, part: RowQuantized, shard_id: object) -> None:
        if tuple(part.shape) != (size, self.in_features):
            raise ValueError(f"shape mismatch for shard {shard_id!r}: {(size, self.in_features)} vs {part.shape}")
        weight = self.weight
        keep = not self._has_dense_rows and can_keep(part, self.out_features, self.in_features, weight.dtype,
                                                     weight.device)  # fmt: skip
        if not keep:
            _copy_rows(weight.data, offset, size, part.dequantize(weight.dtype), shard_id)
            self._has_dense_rows = True
            return
        if self._staging is None:
            self._staging = RowStaging(self.out_features)
        self._staging.put(offset, part)
        if self._staging.complete:
            self.packed = self._staging.build()
            self._staging = None
            weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)  # no dense copy kept

    def _to_dense(self) -> None:
        """A dense shard (or one of another format) arrived: the rows staged so far become dense too."""
        if self._staging is not None:
            for offset, rows in self._staging.dense_rows(self.weight.dtype):
                self.weight.data[offset : offset + rows.shape[0]] = rows
            self._staging = None
            self._has_dense_rows = True

    def quantize(self, method: str, group_size: int = GROUP_SIZE) -> bool:
        """Quantize a loaded dense weight on the fly ("int8": per channel; "int4": round-to-nearest in
        groups along K, where the int4 kernel takes the shape; "nf4": NormalFloat-4 in blocks of 64).
        False if the layer stays as it is."""
        weight = self.weight
        if self.packed is not None or weight.device.type != "cpu":
            return False
        if method == "int8":
            self.packed = ChannelInt8.quantize(weight.data)
        elif method == "int4" and can_pack(self.out_features, self.in_features, weight.dtype, weight.device,
                                           group_size):  # fmt: skip
            self.packed = PackedInt4(rtn_groups(weight.data, group_size))
        elif method == "nf4" and self.in_features % NF4_BLOCK == 0:
            self.packed = NF4Weight.quantize(weight.data)
        else:
            return False
        weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
        return True

    @property
    def weight_nbytes(self) -> int:
        """Bytes the weight occupies in memory, packed or dense."""
        return self.packed.nbytes if self.packed is not None else self.weight.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W.T (+ bias), through whichever form the weight is held in, plus the step's LoRA rows."""
        flat = x.reshape(-1, self.in_features)
        out = F.linear(flat, self.weight, bias) if self.packed is None else self.packed.linear(flat, bias)
        if self.lora is not None:
            out = self.lora.add(flat, out)
        return out.view(*x.shape[:-1], self.out_features)


def _copy_rows(target: torch.Tensor, offset: int, size: int, loaded: torch.Tensor, shard_id: object) -> None:
    rows = target.narrow(0, offset, size)
    if rows.shape != loaded.shape:
        raise ValueError(f"shape mismatch for shard {shard_id!r}: {tuple(rows.shape)} vs {tuple(loaded.shape)}")
    rows.copy_(loaded)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (e.g. q|k|v, gate|up)."""

    def __init__(self, in_features: int, shard_sizes: dict[object, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[object, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size

    def shard_rows(self, shard_id: object) -> tuple[int, int]:
        return (0, self.out_features) if shard_id is None else self.shard_offsets[shard_id]
