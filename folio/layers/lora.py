"""LoRA adapters on a linear layer: the low-rank products of every adapter in the step, added to the base
layer's output row by row, each row by its own request's adapter (or none).

A layer that any adapter targets holds `LoRASlots`: every loaded adapter's A and B stacked along a slot
dim, `A [slots, R, in]` and `B [slots, out, R]`, with the scale folded into B. A fused layer (q|k|v,
gate|up) gives each of its parts `max_rank` of the R columns, and B is block-diagonal over the parts: a
part's rows read only its own columns, so one product serves the whole fused layer. A slot an adapter
does not fill (a part it does not target, a rank below the maximum) stays zero and adds nothing.

The step's `LoRABatch` says which slot each token row uses (-1: the base model alone). Rows are grouped
by slot, and each group's two products run as one matmul each over all its rows, so a step costs at most
two products per adapter present, whatever the number of requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRABatch:
    """Which adapter slot each of the step's token rows uses; shared by every LoRA layer of a model."""

    token_slots: torch.Tensor | None = None  # [T] int64, -1 for rows of the base model; None: no adapter rows
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (slot, its rows [n] int64)

    def set(self, token_slots: list[int], device: torch.device) -> None:
        if all(slot < 0 for slot in token_slots):
            self.clear()
            return
        slots = torch.tensor(token_slots, dtype=torch.long, device=device)
        self.token_slots = slots
        self.groups = [(slot, (slots == slot).nonzero().flatten()) for slot in sorted(set(token_slots)) if slot >= 0]

    def clear(self) -> None:
        self.token_slots, self.groups = None, []

    @property
    def active(self) -> bool:
        return self.token_slots is not None


class LoRASlots:
    def __init__(
        self, in_features: int, out_features: int, parts: list[tuple[int, int]], num_slots: int, max_rank: int,
        batch: LoRABatch, dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        """`parts`: each part's (first output row, rows), one part for an unfused layer."""
        self.parts = parts
        self.max_rank = max_rank
        self.batch = batch
        width = len(parts) * max_rank
        self.a = torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, out_features, width, dtype=dtype, device=device)

    def load(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """One adapter's matrices for one part into `slot`: a [r, in], b [rows, r] (r <= max_rank)."""
        rank = a.shape[0]
        first_row, rows = self.parts[part]
        if rank > self.max_rank:
            raise ValueError(f"an adapter of rank {rank} exceeds the server's --max-lora-rank {self.max_rank}")
        if b.shape != (rows, rank) or a.shape[1] != self.a.shape[2]:
            raise ValueError(f"LoRA matrices of shapes {tuple(a.shape)} and {tuple(b.shape)} do not fit a layer "
                             f"part of {rows} rows by {self.a.shape[2]} inputs")  # fmt: skip
        columns = slice(part * self.max_rank, part * self.max_rank + rank)
        self.a[slot, columns] = a.to(self.a.dtype)
        self.b[slot, first_row : first_row + rows, columns] = (b.float() * scale).to(self.b.dtype)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [T, out_features] + each adapter row's x [T, in] @ A.T @ B.T."""
        if not self.batch.active:
            return out
        for slot, rows in self.batch.groups:
            picked = x.index_select(0, rows)
            delta = (picked @ self.a[slot].T) @ self.b[slot].T
            out.index_add_(0, rows, delta.to(out.dtype))
        return out
