"""Pure-PyTorch paged attention: the CPU default and the oracle for any faster backend.

KV for one layer lives in tensors of shape [num_blocks * block_size, num_kv_heads, head_dim],
addressed by slot (kv_tensors.py; 8-bit caches are dequantized as they are gathered). KV heads are
stored once; grouped-query attention broadcasts them inside SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from folio.layers.attention.kv_tensors import LayerKV
from folio.layers.attention.metadata import AttentionGroup


def attend_group(
    group: AttentionGroup,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: LayerKV,
    block_size: int,
    scale: float,
    sliding_window: int | None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output [t, H * D] for the group's rows of the flat batch; `alibi_slopes` [H] adds
    ALiBi's linear biases to the scores."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    rows = group.token_rows
    # [t, H, D] -> [b, H, q, D]: decodes are b sequences of 1 query, a chunk is 1 sequence of q.
    q = query[rows].view(group.num_seqs, group.query_len, num_heads, head_dim).transpose(1, 2)
    if group.fresh_prompt:
        k = key[rows].unsqueeze(0).transpose(1, 2)
        v = value[rows].unsqueeze(0).transpose(1, 2)
    else:  # each sequence's keys and values, in order, padded: [b, Hkv, num_key_slots, D]
        k = cache.gather("k", group.block_tables, block_size, query.dtype).transpose(1, 2)
        v = cache.gather("v", group.block_tables, block_size, query.dtype).transpose(1, 2)
    if alibi_slopes is None:
        mask = group.mask(sliding_window)
    else:
        mask = group.alibi_bias(sliding_window, alibi_slopes, query.dtype)
    attended = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=num_heads != k.shape[1]
    )
    return attended.transpose(1, 2).reshape(-1, num_heads * head_dim)
