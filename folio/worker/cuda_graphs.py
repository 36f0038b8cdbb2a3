"""CUDA graphs for decode steps on a GPU.

A decode step launches a few kernels per layer (norms, projections, RoPE, the KV write, attention),
each of which takes the CPU longer to launch than a small batch takes the GPU to run. A CUDA graph
records one step's launches once and replays them with a single call, as vLLM and SGLang do for decode.

A graph replays fixed shapes at fixed addresses, so each is captured for a (batch, table width) bucket,
with static inputs of that shape, on first use. A step pads its rows to the batch bucket and its block
tables to the width bucket before replaying:
- padded rows decode token 0 at position 0 in a scratch block that no request holds (the runner binds
  one block more than the pool hands out), so their K/V writes touch no request's cache;
- padded table columns name block 0; they lie past every row's length, so the causal mask hides them
  (block 0's contents are finite: the cache starts zeroed and only real K/V is written to it).
The metadata is built by the same `build_grouped_metadata` the eager path uses, on the CPU, and copied
into the graph's static tensors, so a replay computes exactly what the eager forward of the padded
batch computes. The LM head and sampling stay outside the graph (they read only the real rows).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, fields

import torch
from torch import nn

from folio.layers.attention.metadata import AttentionGroup, AttentionMetadata, build_grouped_metadata
from folio.step import SchedulerOutput
from folio.worker.request_states import RequestStates

# Batch sizes graphs are captured for (a step pads up to the next one), as vLLM's defaults: every size
# up to 4, then steps of 8. A step with more rows runs eagerly.
BATCH_BUCKETS = (1, 2, 4, *range(8, 257, 8))


def batch_bucket(rows: int) -> int | None:
    """The captured batch size a step of `rows` decodes pads to, or None past the largest."""
    index = bisect.bisect_left(BATCH_BUCKETS, rows)
    return BATCH_BUCKETS[index] if index < len(BATCH_BUCKETS) else None


def width_bucket(blocks: int) -> int:
    """Block-table width a step pads to: the next power of two, so a sequence growing to n blocks
    captures log2(n) widths, and attention reads at most twice the keys it needs."""
    return 1 << max(blocks - 1, 0).bit_length()


def metadata_tensors(meta: AttentionMetadata) -> list[torch.Tensor]:
    """Every tensor of a step's metadata, in a fixed order (equal structures give equal orders)."""
    found: list[torch.Tensor] = []
    for view in meta.by_kv_group or [meta]:
        found.append(view.slot_mapping)
        for group in view.groups:
            found.extend(getattr(group, f.name) for f in fields(AttentionGroup) if not f.name.startswith("_")
                         and isinstance(getattr(group, f.name), torch.Tensor))  # fmt: skip
    return found


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # [batch] static inputs, filled before each replay
    positions: torch.Tensor
    meta: AttentionMetadata
    hidden: torch.Tensor  # [batch, hidden]: the graph's output, overwritten by each replay


@dataclass(frozen=True)
class PaddedDecode:
    """A decode step padded to a bucket, as plain values (built on the CPU)."""

    input_ids: list[int]
    positions: list[int]
    tables: list[list[list[int]]]  # per row, per KV cache group: a table of exactly `width` blocks
    batch: int
    width: int


class DecodeGraphs:
    """Captures and replays the model's forward for pure decode steps, one graph per bucket."""

    def __init__(
        self, model: nn.Module, block_size: int, scratch_block: int, num_kv_groups: int, device: torch.device
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.num_kv_groups = num_kv_groups
        self.scratch_block = scratch_block  # a block of the bound cache that the pool never hands out
        self.device = device
        self.pool: tuple[int, int] | None = None  # the graphs' shared memory pool, made at the first capture
        self.captured: dict[tuple[int, int], CapturedStep] = {}
        self.replays = 0  # steps served by a graph (tests and logs read it)

    @staticmethod
    def takes(out: SchedulerOutput) -> bool:
        """Whether the step is pure decode that a captured bucket holds: one token per request, no drafts."""
        return (
            bool(out.scheduled)
            and batch_bucket(len(out.scheduled)) is not None
            and all(c.num_tokens == 1 and c.num_draft_tokens == 0 for c in out.scheduled)
        )

    def pad(self, out: SchedulerOutput, requests: RequestStates) -> PaddedDecode:
        rows = len(out.scheduled)
        batch = batch_bucket(rows)
        assert batch is not None
        tables = [requests[c.request_id].block_tables for c in out.scheduled]
        width = width_bucket(max(len(t) for per_row in tables for t in per_row))
        num_groups = len(tables[0])
        padded_tables = [[t + [0] * (width - len(t)) for t in per_row] for per_row in tables]
        padded_tables += [[[self.scratch_block] * width] * num_groups] * (batch - rows)
        return PaddedDecode(
            input_ids=[c.token_ids[0] for c in out.scheduled] + [0] * (batch - rows),
            positions=[c.start_position for c in out.scheduled] + [0] * (batch - rows),
            tables=padded_tables,
            batch=batch,
            width=width,
        )

    def metadata(self, step: PaddedDecode, device: torch.device | str) -> AttentionMetadata:
        return build_grouped_metadata(step.positions, [1] * step.batch, step.tables, self.block_size, device)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, requests: RequestStates) -> torch.Tensor:
        """The step's hidden states [rows, hidden], from its bucket's graph (captured first if new)."""
        step = self.pad(out, requests)
        captured = self.captured.get((step.batch, step.width))
        if captured is None:
            captured = self._capture(step.batch, step.width)
        fresh = self.metadata(step, "cpu")
        for static, value in zip(metadata_tensors(captured.meta), metadata_tensors(fresh), strict=True):
            static.copy_(value, non_blocking=True)
        captured.input_ids.copy_(torch.tensor(step.input_ids), non_blocking=True)
        captured.positions.copy_(torch.tensor(step.positions), non_blocking=True)
        captured.graph.replay()
        self.replays += 1
        return captured.hidden[: len(out.scheduled)]

    def _capture(self, batch: int, width: int) -> CapturedStep:
        """Warm the forward up at this shape (allocator, cuBLAS handles, a compiled layer's kernels), then
        capture it. Both run on inputs that write only the scratch block."""
        scratch_tables = [[[self.scratch_block] * width] * self.num_kv_groups] * batch
        idle = PaddedDecode([0] * batch, [0] * batch, scratch_tables, batch, width)
        input_ids = torch.tensor(idle.input_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(idle.positions, dtype=torch.long, device=self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # a fresh metadata each time: its masks are cached per object
                self.model(input_ids, positions, self.metadata(idle, self.device))
        torch.cuda.current_stream(self.device).wait_stream(side)
        meta = self.metadata(idle, self.device)  # the static one: its masks are built inside the graph
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self.model(input_ids, positions, meta)
        captured = CapturedStep(graph, input_ids, positions, meta, hidden)
        self.captured[(batch, width)] = captured
        return captured
