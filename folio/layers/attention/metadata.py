"""Per-step attention metadata, built once by the model runner and shared by every layer.

The flat batch is split into attention groups so that no query is padded to another request's
length: all single-token queries (decodes) form one batched group, and each longer query (a prefill
chunk) is its own group. Padding a 1-token decode up to a 512-token prefill chunk would multiply the
attention work by the chunk length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from folio.distributed.context_parallel import ContextSplit
from folio.layers.attention.alibi import alibi_bias


@dataclass
class AttentionGroup:
    token_rows: torch.Tensor  # [t] rows of the flat batch that belong to this group
    block_tables: torch.Tensor  # [b, max_blocks]
    query_positions: torch.Tensor  # [b, q] absolute position of each query (q = 1 for decodes)
    num_key_slots: int  # max_blocks * block_size
    fresh_prompt: bool  # one request whose chunk starts at 0: its keys are exactly this step's keys
    seq_lens: torch.Tensor  # [b] keys each sequence has after this step
    table_seqs: torch.Tensor  # [b] which of the step's sequences each row of block_tables belongs to
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    _alibi: dict[tuple[int | None, int, torch.dtype], torch.Tensor] = field(default_factory=dict)
    _rows: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_seqs(self) -> int:
        return self.query_positions.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.query_positions.shape[1] == 1

    @property
    def query_len(self) -> int:
        return self.query_positions.shape[1]

    def as_decode_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables [t, max_blocks], seq_lens [t]): every query row as a decode of its own, seeing the
        keys up to its position, for the paged attention kernel (which attends a sequence's consecutive
        rows together). Built once per step and shared by every layer."""
        if self._rows is None:
            tables = self.block_tables.repeat_interleave(self.query_len, dim=0)
            self._rows = tables, self.query_positions.flatten() + 1
        return self._rows

    def alibi_bias(self, window: int | None, slopes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[b, H, q, keys] additive bias: ALiBi's slope * (key - query) where mask() allows, -inf elsewhere.
        Built once per step and shared by every layer with the same slopes."""
        key = (window, slopes.data_ptr(), dtype)
        if key not in self._alibi:
            allowed = self.mask(window)
            if allowed is None:  # a fresh prompt: causal over its own keys
                distance = self.query_positions.unsqueeze(-1) - torch.arange(self.query_len, device=slopes.device)
                allowed = (distance >= 0).unsqueeze(1)
            self._alibi[key] = alibi_bias(allowed, self.query_positions, slopes, dtype)
        return self._alibi[key]

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[b, 1, q, keys] bool: causal within the sequence, limited to `window` past positions if given.
        None means plain causal attention over this step's own keys (SDPA's is_causal)."""
        if window in self._masks:
            return self._masks[window]
        if self.fresh_prompt and window is None:
            mask = None
        else:
            num_keys = self.query_len if self.fresh_prompt else self.num_key_slots
            keys = torch.arange(num_keys, device=self.query_positions.device)
            distance = self.query_positions.unsqueeze(-1) - keys  # [b, q, keys]
            allowed = distance >= 0
            if window is not None:
                allowed &= distance < window
            mask = allowed.unsqueeze(1)
        self._masks[window] = mask
        return mask


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot each new token's K/V is written to
    groups: list[AttentionGroup]
    num_tokens: int
    # With the context split over ranks: this rank's rows and slots (the groups cover every rank's rows).
    context: ContextSplit | None = None
    # With several KV cache groups (kv_cache/groups.py): the same step over each group's block tables,
    # this one being the first. Empty with one group.
    by_kv_group: list[AttentionMetadata] = field(default_factory=list)

    def for_kv_group(self, group: int) -> AttentionMetadata:
        """The step as the layers of KV cache group `group` see it: their slots and block tables."""
        return self.by_kv_group[group] if self.by_kv_group else self


def build_grouped_metadata(
    start_positions: list[int],
    query_lens: list[int],
    tables: list[list[list[int]]],
    block_size: int,
    device: torch.device | str = "cpu",
    as_decodes: Sequence[bool] = (),
) -> AttentionMetadata:
    """`build_attention_metadata` for sequences with one block table per KV cache group (`tables[i][g]`):
    the first group's metadata, holding every group's in `by_kv_group`. A sequence's tables all have one
    length, so the other groups' views share the first one's rows, positions and masks and differ only in
    their slots and block tables."""
    num_groups = max(len(tables[0]), 1) if tables else 1
    first = build_attention_metadata(start_positions, query_lens, [t[0] for t in tables], block_size, device,
                                     as_decodes)  # fmt: skip
    if num_groups == 1:
        return first
    seq_of_row = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    positions = torch.cat([torch.arange(s, s + q) for s, q in zip(start_positions, query_lens, strict=True)])
    every = _padded([t for seq in tables for t in seq]).view(len(tables), num_groups, -1)  # [S, G, W]
    slots = (every[seq_of_row, :, positions // block_size] * block_size + (positions % block_size)[:, None]).T
    slots = slots.contiguous().to(device)  # [G, T]
    # Each attention group's rows of every KV cache group's tables: [G, b, w].
    group_tables = [every[g.table_seqs, :, : g.block_tables.shape[1]].transpose(0, 1).contiguous().to(device)
                    for g in first.groups]  # fmt: skip
    views = [first]
    for group in range(1, num_groups):
        regrouped = [
            replace(g, block_tables=t[group], _rows=None) for g, t in zip(first.groups, group_tables, strict=True)
        ]
        views.append(AttentionMetadata(slots[group], regrouped, first.num_tokens))
    first.by_kv_group = views
    return first


def _padded(tables: list[list[int]]) -> torch.Tensor:
    """[len(tables), longest] int64, zero-padded (through numpy: torch.tensor of nested lists is ~4x slower)."""
    padded = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
    for row, table in enumerate(tables):
        padded[row, : len(table)] = table
    return torch.from_numpy(padded)


def build_attention_metadata(
    start_positions: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    as_decodes: Sequence[bool] = (),
) -> AttentionMetadata:
    """`as_decodes[i]`: attend sequence i's query rows as that many decode rows (a speculative
    verification: k + 1 rows over the same block table, each seeing the keys up to its own position).
    Every row's K/V is written before any row attends, so that is exactly causal attention, and the
    step stays a pure decode step for the decode kernel and the C++ decode step."""
    slots: list[int] = []
    decodes: list[tuple[int, int, list[int], int]] = []  # each decode row's (row, position, table, sequence)
    groups: list[AttentionGroup] = []
    row = 0
    for seq, (start, qlen, table) in enumerate(zip(start_positions, query_lens, block_tables, strict=True)):
        slots.extend(table[pos // block_size] * block_size + pos % block_size for pos in range(start, start + qlen))
        if qlen == 1 or (seq < len(as_decodes) and as_decodes[seq]):
            decodes.extend((row + i, start + i, table, seq) for i in range(qlen))
        else:
            groups.append(
                _group(list(range(row, row + qlen)), [start], qlen, [table], [seq], block_size, start == 0, device)
            )
        row += qlen
    if decodes:
        rows, starts, tables, seqs = (list(column) for column in zip(*decodes, strict=True))
        groups.insert(0, _group(rows, starts, 1, tables, seqs, block_size, False, device))
    return AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=device), groups, row)


def _group(
    rows: list[int],
    starts: list[int],
    query_len: int,
    tables: list[list[int]],
    seqs: list[int],
    block_size: int,
    fresh_prompt: bool,
    device: torch.device | str,
) -> AttentionGroup:
    padded = _padded(tables)
    max_blocks = padded.shape[1]
    positions = torch.tensor(starts, dtype=torch.long).unsqueeze(1) + torch.arange(query_len).unsqueeze(0)
    return AttentionGroup(
        token_rows=torch.tensor(rows, dtype=torch.long, device=device),
        block_tables=padded.to(device),
        query_positions=positions.to(device),
        num_key_slots=max_blocks * block_size,
        fresh_prompt=fresh_prompt,
        seq_lens=(positions[:, -1] + 1).to(device),
        table_seqs=torch.tensor(seqs, dtype=torch.long),
    )
