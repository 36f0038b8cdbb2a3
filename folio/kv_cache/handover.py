"""Whole KV blocks of a prompt's prefix, as a value one engine hands another (prefill/decode
disaggregation): each block named by its prefix-cache key, its K/V in the cache's own format."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

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
    # Per layer: K, V (and scales), each [n, B, ...] as raw bytes (numpy: Ray's object store reads it in place).
    layers: list[list[np.ndarray]] = field(default_factory=list)
    compute_seconds: float = 0.0  # what computing the prompt took the sender (the rest of a hand-over is transfer)

    @property
    def num_blocks(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for parts in self.layers for part in parts)
