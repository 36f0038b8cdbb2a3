"""Token embedding and the LM head (which may share the embedding's weight).

Either may hold its weight as 8-bit groups (`Int8Groups`, from a GGUF Q8_0 tensor): a lookup then
dequantizes only the rows it needs, and the LM head multiplies through the int8 kernel, so the
largest matrix of a small model never exists in 16/32 bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from folio.layers.linear import default_weight_loader
from folio.quant.int8 import Int8Groups


class _QuantizableWeight(nn.Module):
    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.int8: Int8Groups | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | Int8Groups, shard_id: object = None) -> None:
        if not isinstance(loaded, Int8Groups):
            default_weight_loader(param, loaded)
            return
        if loaded.shape != tuple(param.shape):
            raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {loaded.shape}")
        self.int8 = loaded
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)  # no dense copy kept

    @property
    def packed(self) -> Int8Groups | None:
        """The quantized weight, for resident-size accounting (see model_loader)."""
        return self.int8


class VocabEmbedding(_QuantizableWeight):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return self.int8.embedding(input_ids, self.weight.dtype)
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.tied_to = tied_to
        self.own = None if tied_to is not None else _QuantizableWeight(vocab_size, dim)
        if self.own is not None:
            self.weight = self.own.weight

    @property
    def source(self) -> _QuantizableWeight:
        return self.tied_to if self.tied_to is not None else self.own

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        source = self.source
        if source.int8 is not None:
            return source.int8.linear(hidden)
        return F.linear(hidden, source.weight)
