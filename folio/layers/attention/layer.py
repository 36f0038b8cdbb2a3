"""The attention layer a model holds: writes new K/V into its slice of the paged cache, then attends."""

from __future__ import annotations

import torch
from torch import nn

from folio.layers.attention.metadata import AttentionMetadata
from folio.layers.attention.torch_paged import paged_attention, write_kv


class PagedAttention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int | None = None
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # Bound by the model runner once the pool is sized.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.block_size = 0

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int) -> None:
        self.k_cache, self.v_cache, self.block_size = k_cache, v_cache, block_size

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H * D]."""
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("attention layer has no KV cache bound; the model runner binds it at start-up")
        write_kv(self.k_cache, self.v_cache, k, v, meta.slot_mapping)
        return paged_attention(q, self.k_cache, self.v_cache, meta, self.block_size, self.scale, self.sliding_window)
