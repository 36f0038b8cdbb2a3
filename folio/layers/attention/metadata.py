"""Per-step attention metadata, built once by the model runner and shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Describes a flat batch of T tokens from B requests.

    Queries are scattered into a padded [B, max_query_len] grid (`query_index` gives each flat
    token's cell); keys are read through `block_tables` into a padded [B, max_blocks * block_size]
    grid. `mask` marks which key each query cell may see (causal, within its own sequence).
    """

    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # [B, max_blocks]
    query_index: torch.Tensor  # [T] cell in the padded [B * max_query_len] query grid
    query_positions: torch.Tensor  # [B, max_query_len] absolute position of each query cell
    num_seqs: int
    max_query_len: int
    num_key_slots: int  # max_blocks * block_size
    mask: torch.Tensor  # [B, 1, max_query_len, num_key_slots] bool
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def window_mask(self, window: int | None) -> torch.Tensor:
        """The causal mask, further limited to the last `window` positions (sliding-window layers)."""
        if window is None:
            return self.mask
        cached = self._window_masks.get(window)
        if cached is None:
            keys = torch.arange(self.num_key_slots)
            distance = self.query_positions.unsqueeze(-1) - keys  # [B, Q, K]
            cached = self.mask & (distance < window).unsqueeze(1)
            self._window_masks[window] = cached
        return cached


def build_attention_metadata(
    start_positions: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    num_seqs = len(query_lens)
    max_query_len = max(query_lens)
    max_blocks = max(len(t) for t in block_tables)

    slots: list[int] = []
    query_index: list[int] = []
    for seq, (start, qlen, table) in enumerate(zip(start_positions, query_lens, block_tables, strict=True)):
        for pos in range(start, start + qlen):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        base = seq * max_query_len
        query_index.extend(range(base, base + qlen))

    padded_tables = torch.zeros(num_seqs, max_blocks, dtype=torch.long)
    for seq, table in enumerate(block_tables):
        padded_tables[seq, : len(table)] = torch.tensor(table, dtype=torch.long)

    starts = torch.tensor(start_positions, dtype=torch.long)
    query_positions = starts.unsqueeze(1) + torch.arange(max_query_len).unsqueeze(0)
    num_key_slots = max_blocks * block_size
    keys = torch.arange(num_key_slots)
    # Causal: a query at position p sees keys 0..p of its own sequence. Padded query cells sit past
    # the sequence end but still see key 0, so no row is fully masked (which would produce NaN).
    mask = (keys.view(1, 1, -1) <= query_positions.unsqueeze(-1)).unsqueeze(1)

    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=padded_tables.to(device),
        query_index=torch.tensor(query_index, dtype=torch.long, device=device),
        query_positions=query_positions.to(device),
        num_seqs=num_seqs,
        max_query_len=max_query_len,
        num_key_slots=num_key_slots,
        mask=mask.to(device),
    )
