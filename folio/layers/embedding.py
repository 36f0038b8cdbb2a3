"""Token embedding and the LM head (which may share the embedding's weight).

Either may hold its weight as 8-bit groups (`Int8Groups` from a GGUF Q8_0 tensor, tiled on CPU as
`PackedInt8`): a lookup then dequantizes only the rows it needs, and the LM head multiplies through
the int8 kernel, so the largest matrix of a small model never exists in 16/32 bits.

Under tensor parallelism both are split along the vocabulary (each rank holds a contiguous range of
rows): a lookup embeds the ids in this rank's range, zeroes the rest and sums over ranks; the LM
head computes this rank's logits and gathers the rest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from folio.distributed.tensor_parallel import TensorParallel, current
from folio.layers.linear import default_weight_loader
from folio.layers.split_argmax import local_best
from folio.layers.weight_narrowing import narrow_weight
from folio.weight_formats.int8 import Int8Groups, PackedInt8, packed_for_kernel


class _QuantizableWeight(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = current() if tp is None else tp
        # Ranks hold ceil(V / ranks) rows each, the last one fewer when V does not divide.
        self.rows_per_rank = -(-vocab_size // self.tp.size)
        self.first_row = min(self.tp.rank * self.rows_per_rank, vocab_size)
        self.num_rows = min(self.rows_per_rank, vocab_size - self.first_row)
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(self.num_rows, dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.loads_slices = True  # narrows a lazy tensor to its rows before reading it
        self.int8: PackedInt8 | Int8Groups | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | Int8Groups, shard_id: object = None) -> None:
        loaded = narrow_weight(loaded, 0, self.first_row, self.num_rows)
        if not isinstance(loaded, Int8Groups):
            default_weight_loader(param, loaded)
            return
        if loaded.shape != tuple(param.shape):
            raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {loaded.shape}")
        self.int8 = packed_for_kernel(loaded)
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)  # no dense copy kept

    @property
    def packed(self) -> PackedInt8 | Int8Groups | None:
        """The quantized weight, for resident-size accounting (see model_loader)."""
        return self.int8


class VocabEmbedding(_QuantizableWeight):
    """`tp`: the group to split over; None takes the one being built (a position table passes SINGLE)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(input_ids)
        outside = (input_ids < self.first_row) | (input_ids >= self.first_row + self.num_rows)
        local = (input_ids - self.first_row).masked_fill(outside, 0)
        embedded = self._lookup(local).masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(embedded)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return self.int8.embedding(ids, self.weight.dtype)
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.tied_to = tied_to
        self.own = None if tied_to is not None else _QuantizableWeight(vocab_size, dim)
        if self.own is not None:
            self.weight = self.own.weight
        self._buffer: torch.Tensor | None = None  # transient_logits' rows, grown to the most asked for

    @property
    def source(self) -> _QuantizableWeight:
        return self.tied_to if self.tied_to is not None else self.own

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of this rank's vocabulary range (all of it when whole), [N, num_rows]."""
        source = self.source
        return source.int8.linear(hidden) if source.int8 is not None else F.linear(hidden, source.weight)

    def transient_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`local_logits(hidden)` in float32, in a buffer the head reuses: valid until its next call, for a
        caller that reduces them at once (the greedy pick). A batch's logits are large (64 rows of Gemma
        3's 262k vocabulary: 67 MB); allocated each step, glibc maps such a block afresh (past its 32 MB
        mmap threshold) and every page faults in as the kernel writes it, which cost ~15% of a batch-64
        step."""
        source = self.source
        rows = hidden.shape[0]
        if hidden.dtype != torch.float32 or hidden.device.type != "cpu":
            return self.local_logits(hidden).float()
        out = self._buffer_rows(rows)
        if isinstance(source.int8, PackedInt8):
            return source.int8.linear_into(hidden, out)
        if source.int8 is not None or source.weight.dtype != torch.float32:
            return self.local_logits(hidden).float()
        return torch.mm(hidden, source.weight.t(), out=out)

    def greedy_best(self, hidden: torch.Tensor) -> torch.Tensor:
        """`local_best` of this rank's logits for `hidden` [N, dim]: [N, 3] float64 (each row's best value,
        its token id, 1.0 if the row was not all finite). An 8-bit head (a GGUF file's tied embedding)
        picks from its 8-bit product and the few tiles that can still win (PackedInt8.greedy): the same
        tokens and values as the full product, for about half its integer work and no logits written."""
        source = self.source
        packed = source.int8
        picked = packed.greedy(hidden) if isinstance(packed, PackedInt8) else None
        if picked is None:
            return local_best(self.transient_logits(hidden), source.first_row)
        best, decided = picked
        if not bool(decided.all()):  # rows the bound left open: their full product decides
            undecided = (~decided).nonzero().flatten()
            best[undecided] = local_best(packed.linear(hidden[undecided]).float(), 0)
        best[:, 1] += source.first_row
        return best

    def prepare_greedy(self) -> None:
        """Make at start-up what `greedy_best` reads."""
        if isinstance(self.source.int8, PackedInt8):
            self.source.int8.prepare_greedy()

    def _buffer_rows(self, rows: int) -> torch.Tensor:
        """[rows, num_rows] float32 of the reused logits buffer, grown to the most rows asked for."""
        if self._buffer is None or self._buffer.shape[0] < rows:
            self._buffer = torch.empty(rows, self.source.num_rows, dtype=torch.float32)
        return self._buffer[:rows]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        source = self.source
        logits = self.local_logits(hidden)
        if source.tp.size == 1:
            return logits
        if source.num_rows < source.rows_per_rank:  # the last rank's short range, padded to gather
            logits = F.pad(logits, (0, source.rows_per_rank - source.num_rows))
        return source.tp.all_gather_last(logits)[..., : source.vocab_size]
