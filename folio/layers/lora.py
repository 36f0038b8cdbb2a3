"""LoRA adapters on a linear layer: the low-rank products of every adapter in the step, added to the base
layer's output row by row, each row by its own request's adapter (or none).

A layer that any adapter targets holds `LoRASlots`: every loaded adapter's matrices stacked along a slot
dim, `A [slots, W, in]` and `B [slots, R, out]` (B transposed, the scale folded in). A fused layer (q|k|v,
gate|up) has parts: each part's A takes `max_rank` of the W columns, and since the parts split the output
rows between them, one R x out B holds every part's B, each in its own rows' columns. What an adapter
does not fill (a part it does not target, a rank below the maximum) stays zero and adds nothing.

The step's `LoRABatch` says which slot each token row uses (-1: the base model alone). A step of few rows
per adapter (decode, short prompts) adds them all in one C++ call (folio/csrc/lora_rows.h: Punica's
gathered matmul, each adapter's matrices read once, two parallel regions for any mix of adapters); a long
prefill, or a step where the kernel is missing, groups rows by slot and runs each group's two products as
one matmul each, which is also the kernel's test oracle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from folio.layers import fused_ops

# Steps whose adapters have at most this many rows each on average take the C++ kernel; longer ones (a
# long prefill) keep PyTorch's matmuls, which reuse each adapter row across many tokens better than the
# kernel's dot products.
KERNEL_MAX_ROWS = 64
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # of the activations, and of the adapters' matrices


@dataclass
class LoRABatch:
    """Which adapter slot each of the step's token rows uses; shared by every LoRA layer of a model."""

    token_slots: torch.Tensor | None = None  # [T] int64, -1 for rows of the base model; None: no adapter rows
    slots_used: int = 0  # distinct adapters among the rows
    layouts: int = 0  # LoRASlots made so far: the C++ decode step re-reads the layers' slots when it grows
    _groups: list[tuple[int, torch.Tensor]] | None = field(default=None, repr=False)

    def set(self, token_slots: list[int], device: torch.device) -> None:
        if all(slot < 0 for slot in token_slots):
            self.clear()
            return
        self.token_slots = torch.tensor(token_slots, dtype=torch.long, device=device)
        self.slots_used = len({slot for slot in token_slots if slot >= 0})
        self._groups = None

    def clear(self) -> None:
        self.token_slots, self.slots_used, self._groups = None, 0, None

    @property
    def active(self) -> bool:
        return self.token_slots is not None

    @property
    def groups(self) -> list[tuple[int, torch.Tensor]]:
        """(slot, its rows [n] int64) per adapter: made on first use (only the PyTorch path uses them)."""
        slots = self.token_slots
        if self._groups is None and slots is not None:
            self._groups = [(slot, (slots == slot).nonzero().flatten()) for slot in slots[slots >= 0].unique().tolist()]
        return self._groups or []


class LoRASlots:
    def __init__(
        self, in_features: int, out_features: int, parts: list[tuple[int, int]], num_slots: int, max_rank: int,
        batch: LoRABatch, dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        """`parts`: each part's (first output row, rows), one part for an unfused layer."""
        self.parts = parts
        self.flat_parts = [value for part in parts for value in part]  # as the kernel takes them
        self.max_rank = max_rank
        self.batch = batch
        width = len(parts) * max_rank
        self.a = torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        # B's rows one cache line longer than its out_features: rows a multiple of 4 KiB apart (3072 float32s)
        # share a set of the L1 cache, and a rank's worth of them read together would evict each other.
        padded = out_features + 512 // torch.finfo(dtype).bits  # 64 bytes more
        self.b = torch.zeros(num_slots, max_rank, padded, dtype=dtype, device=device)[..., :out_features]
        batch.layouts += 1  # the C++ decode step takes the layers' slots again (decode_stack.py)

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
        self.b[slot, :rank, first_row : first_row + rows] = (b.float() * scale).T.to(self.b.dtype)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [T, out_features] + each adapter row's x [T, in] @ A.T @ B.T."""
        batch = self.batch
        if batch.token_slots is None:
            return out
        kernel = fused_ops.fused_ops_for(x) if x.shape[0] <= KERNEL_MAX_ROWS * batch.slots_used else None
        if kernel is not None and x.dtype == out.dtype and x.dtype in KERNEL_DTYPES and self.a.dtype in KERNEL_DTYPES:
            kernel.lora_add(x, out, self.a, self.b, batch.token_slots, self.flat_parts)
            return out
        return self.add_by_groups(x, out)

    def add_by_groups(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`add` in PyTorch: each slot's rows through two matmuls (the kernel's oracle)."""
        rank = self.max_rank
        for slot, rows in self.batch.groups:
            shrunk = x.index_select(0, rows) @ self.a[slot].to(x.dtype).T  # [n, W]
            delta = torch.zeros(rows.shape[0], out.shape[1], dtype=shrunk.dtype, device=out.device)
            for part, (first_row, part_rows) in enumerate(self.parts):
                rows_of_part = slice(first_row, first_row + part_rows)
                b = self.b[slot, :, rows_of_part].to(x.dtype)
                delta[:, rows_of_part] = shrunk[:, part * rank : (part + 1) * rank] @ b
            out.index_add_(0, rows, delta.to(out.dtype))
        return out
