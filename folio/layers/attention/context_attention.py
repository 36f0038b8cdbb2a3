"""Attention when the context is split over ranks (folio/distributed/context_parallel.py).

Each rank writes its rows' keys and values into its own cache, gathers every rank's queries, and
attends all of them over the keys it holds: a partial result per query and head, the softmax-weighted
sum of its values and the log of its softmax denominator (log-sum-exp). The ranks swap those so that
each holds its own rows' partials from every rank, and merges them exactly:

    lse = log(sum_r exp(lse_r)),  out = sum_r exp(lse_r - lse) * out_r

which is softmax attention over the union of the ranks' keys (ring attention's merge). A rank's keys
are the positions p = rank (mod ranks), so its slots map to positions through `key_positions`, and
masks (causal, sliding window) and ALiBi biases are computed from those positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from folio.distributed.context_parallel import ContextSplit
from folio.layers.attention.kv_tensors import LayerKV
from folio.layers.attention.metadata import AttentionGroup, AttentionMetadata

# A prompt chunk's queries are attended in tiles of this many rows, bounding the scores' memory.
QUERY_TILE = 512


def attend_split_context(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    cache: LayerKV,
    scale: float,
    sliding_window: int | None,
    alibi_slopes: torch.Tensor | None,
) -> torch.Tensor:
    """q [n, H, D], k/v [n, Hkv, D]: this rank's rows (or its stand-in row) -> [n, H * D]."""
    split = meta.context
    assert split is not None
    n, heads, dim = split.num_local, q.shape[1], q.shape[2]
    if n:
        cache.write(k[:n], v[:n], split.slots)
    queries = split.gather_rows(q.float())  # [T, H, D], every rank's rows in flat order
    partial = torch.empty(split.num_rows, heads, dim + 1)
    for group in meta.groups:
        held = local_keys(group, split, cache, k[:n], v[:n])
        out, lse = partial_attention(group, queries, held, scale, sliding_window, alibi_slopes)
        partial[group.token_rows, :, :dim] = out
        partial[group.token_rows, :, dim] = lse
    mine = split.own_rows_from_every(partial.view(split.num_rows, -1)).view(split.cp.size, n, heads, dim + 1)
    result = q.new_zeros(q.shape[0], heads * dim)
    result[:n] = merge_partials(mine).view(n, heads * dim).to(q.dtype)
    return result


def merge_partials(parts: torch.Tensor) -> torch.Tensor:
    """[ranks, n, H, D + 1] (output, then log-sum-exp, per rank) -> [n, H, D] attention over all keys."""
    lse = parts[..., -1]
    total = torch.logsumexp(lse, dim=0)  # finite: a query always sees its own key, on its own rank
    weights = torch.exp(lse - total).unsqueeze(-1)
    return (weights * parts[..., :-1]).sum(dim=0)


@dataclass
class HeldKeys:
    """The keys and values one rank holds for a group's sequences: [b, Hkv, K, D] float32 each, and
    the position of each key [K] (padding slots sit past every query's position, so they are masked)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor


def local_keys(
    group: AttentionGroup, split: ContextSplit, cache: LayerKV, k: torch.Tensor, v: torch.Tensor
) -> HeldKeys:
    """This rank's keys for the group. A fresh prompt's are exactly this step's rows that the rank
    computed (`k`, `v`: [n, Hkv, D]), taken as computed, before an 8-bit cache rounds them, as the
    whole model's path takes them; every other group reads the rank's cache through its tables."""
    if group.fresh_prompt:
        held = split.owners[group.token_rows] == split.cp.rank
        rows = split.index_in_owner[group.token_rows[held]]
        positions = group.query_positions[0][held]
        return HeldKeys(k[rows].float().transpose(0, 1).unsqueeze(0), v[rows].float().transpose(0, 1).unsqueeze(0),
                        positions)  # fmt: skip
    keys = cache.gather("k", group.block_tables, split.slots_per_block, torch.float32).transpose(1, 2)
    values = cache.gather("v", group.block_tables, split.slots_per_block, torch.float32).transpose(1, 2)
    return HeldKeys(keys, values, split.key_positions(group.block_tables.shape[1]).to(keys.device))


def partial_attention(
    group: AttentionGroup,
    queries: torch.Tensor,
    held: HeldKeys,
    scale: float,
    sliding_window: int | None,
    alibi_slopes: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's queries over the keys `held` on this rank: (output [t, H, D], log-sum-exp [t, H]),
    both float32; a query with no key here gets output 0 and log-sum-exp -inf."""
    heads, dim = queries.shape[1], queries.shape[2]
    b, qlen = group.num_seqs, group.query_len
    q = queries[group.token_rows].view(b, qlen, heads, dim).transpose(1, 2)  # [b, H, q, D]
    keys, values, key_positions = held.keys, held.values, held.positions
    kv_heads = keys.shape[1]
    group_size = heads // kv_heads  # query heads per KV head (grouped-query attention)
    outs, lses = [], []
    for first in range(0, qlen, QUERY_TILE):
        query_positions = group.query_positions[:, first : first + QUERY_TILE]
        distance = query_positions.unsqueeze(-1) - key_positions  # [b, q, keys]
        allowed = distance >= 0
        if sliding_window is not None:
            allowed &= distance < sliding_window
        bias = torch.zeros(allowed.shape, dtype=torch.float32).unsqueeze(1)  # [b, 1, q, keys]
        if alibi_slopes is not None:
            bias = alibi_slopes.view(1, -1, 1, 1).float() * -distance.unsqueeze(1).float()
        bias = bias.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        tile = q[:, :, first : first + QUERY_TILE]
        rows = tile.shape[2]
        # The query heads sharing a KV head become rows of one head: no copy of the keys per head.
        folded_bias = bias.expand(b, heads, rows, bias.shape[-1]).reshape(b, kv_heads, group_size * rows, -1)
        out, lse = attention_with_lse(tile.reshape(b, kv_heads, group_size * rows, dim), keys, values, folded_bias,
                                      scale)  # fmt: skip
        lse = lse.reshape(b, heads, rows).masked_fill(~allowed.any(dim=-1).unsqueeze(1), float("-inf"))
        outs.append(out.reshape(b, heads, rows, dim))
        lses.append(lse)
    out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)  # [b, H, q, D], [b, H, q]
    return out.transpose(1, 2).reshape(-1, heads, dim), lse.transpose(1, 2).reshape(-1, heads)


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention [b, H, q, D] and its log-sum-exp [b, H, q], float32, with an additive `bias`
    (-inf where masked). On CPU, ATen's fused flash kernel (which returns both); elsewhere the plain
    arithmetic, which is also the tests' reference. A row masked throughout gets output 0; its
    log-sum-exp is meaningless and the caller sets it."""
    if q.device.type == "cpu" and q.shape[2] and k.shape[2]:
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                              scale=scale)  # fmt: skip
        return out, lse
    return plain_attention_with_lse(q, k, v, bias, scale)


def plain_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = q @ k.transpose(-1, -2) * scale + bias
    lse = torch.logsumexp(scores, dim=-1)
    safe = lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1)  # exp(-inf - 0) = 0 on masked rows
    return torch.exp(scores - safe) @ v, lse
