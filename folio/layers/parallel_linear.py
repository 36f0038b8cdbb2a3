"""Linear layers split across tensor-parallel ranks (Megatron-LM's scheme, as vLLM uses it).

- `ColumnParallelLinear`: output features split; each rank computes its slice, no communication.
  q|k|v and gate|up are fused column-parallel layers whose parts are split each on its own (a rank
  holds its heads' q, k and v rows), KV heads replicated when there are fewer than ranks.
- `RowParallelLinear`: input features split (they are the previous column-parallel layer's slice);
  each rank's partial product is summed by one all-reduce, and the bias added once after it.

Sharding happens in the weight loaders: each takes the checkpoint tensor, narrows it to this rank's
rows or columns (`narrow_weight`: quantized formats on their group boundaries, never widened) and
loads only that. With one rank these are plain `Linear` / `MergedLinear` layers.
"""

from __future__ import annotations

import torch
from torch import nn

from folio.distributed.tensor_parallel import HeadShard, TensorParallel, current
from folio.layers.linear import Linear, MergedLinear
from folio.layers.weight_narrowing import narrow_weight
from folio.layers.weight_storage import RowQuantized

Loaded = torch.Tensor | RowQuantized


class ColumnParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp = current()
        start, size = self.tp.split(out_features, "output features")
        super().__init__(in_features, size, bias)
        self.first_row = start
        _loads_slices(self)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        super().weight_loader(param, narrow_weight(loaded, 0, self.first_row, self.out_features), shard_id)


# A fused layer's part: (its rows in the checkpoint tensor, the first of them this rank holds, how many).
PartSplit = tuple[int, int, int]


class MergedColumnParallelLinear(MergedLinear):
    """Parts stacked along the output dim, each split across ranks by its own `PartSplit`."""

    def __init__(self, in_features: int, parts: dict[object, PartSplit], bias: bool = False) -> None:
        super().__init__(in_features, {shard_id: local for shard_id, (_, _, local) in parts.items()}, bias)
        self.tp = current()
        self.parts = parts
        _loads_slices(self)

    @classmethod
    def even(cls, in_features: int, sizes: dict[object, int], bias: bool = False) -> MergedColumnParallelLinear:
        """Every part split evenly (gate|up)."""
        tp = current()
        parts = {shard_id: (size, *tp.split(size, "output features")) for shard_id, size in sizes.items()}
        return cls(in_features, parts, bias)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        if shard_id is None:  # a checkpoint that fuses the parts itself (Phi-3, GPT-2): split it first
            offset = 0
            for part_id, (full, _, _) in self.parts.items():
                self.weight_loader(param, narrow_weight(loaded, 0, offset, full), part_id)
                offset += full
            return
        _, first, size = self.parts[shard_id]
        super().weight_loader(param, narrow_weight(loaded, 0, first, size), shard_id)


class RowParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp: TensorParallel = current()
        start, size = self.tp.split(in_features, "input features")
        super().__init__(size, out_features, bias)
        self.first_column = start
        _loads_slices(self)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        # Columns of the weight; the bias (one dim) is whole, only read if it is lazy.
        super().weight_loader(param, narrow_weight(loaded, 1, self.first_column, self.in_features), shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        out = self.tp.all_reduce(self.project(x, None))
        return out if self.bias is None else out + self.bias


def _loads_slices(layer: Linear) -> None:
    """Its loader narrows lazy checkpoint tensors itself (narrow_weight), reading only its slice."""
    for param in (layer.weight, layer.bias):
        if param is not None:
            param.loads_slices = True


def qkv_parallel(
    hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, heads: HeadShard, bias: bool = False
) -> MergedColumnParallelLinear:
    """q|k|v for this rank's heads (`heads`, from head_shard)."""
    kv_part = (num_kv_heads * head_dim, heads.first_kv_head * head_dim, heads.num_kv_heads * head_dim)
    parts = {"q": (num_heads * head_dim, heads.first_head * head_dim, heads.num_heads * head_dim), "k": kv_part,
             "v": kv_part}  # fmt: skip
    return MergedColumnParallelLinear(hidden_size, parts, bias)
