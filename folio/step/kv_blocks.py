"""Whole KV blocks of a prompt's prefix, as a value one engine hands another (prefill/decode
disaggregation): each block named by its prefix-cache key, its K/V in the cache's own format."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from folio.kv_cache.hashing import BlockKey


@dataclass(frozen=True)
class KVLayout:
    """What two caches must share for one's blocks to mean the same in the other."""

    block_size: int
    num_layers: int
    kv_cache_dtype: str  # "auto" (the model's dtype), "int8" or "fp8"
    model_dtype: str
    shapes: tuple[tuple[int, ...], ...]  # one layer's per-slot tensor shapes: K, V (and scales)


@dataclass
class KVBlocks:
    layout: KVLayout
    keys: list[BlockKey]  # the blocks' identities, in prompt order
    layers: list[list[torch.Tensor]] = field(default_factory=list)  # per layer: K, V (, scales), [n, B, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for parts in self.layers for t in parts)
