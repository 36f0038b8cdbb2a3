"""Pure-PyTorch paged attention: the CPU default and the oracle for any faster backend.

KV for one layer lives in a tensor of shape [num_blocks * block_size, num_kv_heads, head_dim],
addressed by slot. KV heads are stored once; grouped-query attention broadcasts them inside SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from folio.layers.attention.metadata import AttentionMetadata


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> None:
    k_cache.index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, value.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, meta: AttentionMetadata, block_size: int) -> torch.Tensor:
    """[slots, Hkv, D] cache -> [B, Hkv, num_key_slots, D] per-sequence keys (padded)."""
    num_kv_heads, head_dim = cache.shape[1], cache.shape[2]
    blocks = cache.view(-1, block_size, num_kv_heads, head_dim)[meta.block_tables]  # [B, nb, bs, H, D]
    return blocks.view(meta.num_seqs, meta.num_key_slots, num_kv_heads, head_dim).transpose(1, 2)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query: [T, H, D] -> [T, H * D]."""
    num_tokens, num_heads, head_dim = query.shape
    padded = query.new_zeros(meta.num_seqs * meta.max_query_len, num_heads, head_dim)
    padded[meta.query_index] = query
    q = padded.view(meta.num_seqs, meta.max_query_len, num_heads, head_dim).transpose(1, 2)
    k = gather_kv(k_cache, meta, block_size).to(query.dtype)
    v = gather_kv(v_cache, meta, block_size).to(query.dtype)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=meta.window_mask(sliding_window), scale=scale, enable_gqa=num_heads != k.shape[1]
    )
    out = out.transpose(1, 2).reshape(meta.num_seqs * meta.max_query_len, num_heads * head_dim)
    return out[meta.query_index]
