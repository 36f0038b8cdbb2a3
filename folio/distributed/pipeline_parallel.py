"""The pipeline stage a model is built for: which contiguous layers it holds, and how hidden states
travel to the next stage.

Stage 0 holds the embedding, the last stage the final norm and the LM head, and every stage a
contiguous range of decoder layers (and only their KV cache). The ranges balance each stage's share
of the weights, the LM head counted in the last stage's: a head as large as Gemma 3's (262,144 x 640)
outweighs most of its layers, so an even split of the layers would leave the last stage the slowest.

As with `building(tp)` (tensor_parallel.py), a model learns its stage when it is constructed
(`building_stage`); outside that scope a model is whole. Hidden states move between stages with
torch.distributed point-to-point sends (gloo on CPU, NCCL on CUDA); their wall time is counted in
`COMM` with the collectives'.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist

from folio.config import ModelConfig
from folio.distributed.tensor_parallel import COMM


@dataclass(frozen=True)
class PipelineStage:
    stage: int = 0
    size: int = 1
    prev_rank: int | None = None  # the global rank this one receives hidden states from
    next_rank: int | None = None  # ... and sends them to
    layer_counts: tuple[int, ...] | None = None  # layers per stage as the user chose; None: balanced

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def layer_range(self, config: ModelConfig) -> range:
        """The decoder layers this stage holds."""
        return partition_layers(config, self.size, self.layer_counts)[self.stage]

    def send(self, tensor: torch.Tensor) -> Any:
        """Start sending `tensor` to the next stage; the caller keeps it alive until the returned
        work is waited on."""
        assert self.next_rank is not None, "the last stage sends nothing"
        return dist.isend(tensor.contiguous(), self.next_rank)

    def receive(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        assert self.prev_rank is not None, "the first stage receives nothing"
        tensor = torch.empty(shape, dtype=dtype, device=device)
        started = time.perf_counter()
        dist.recv(tensor, self.prev_rank)
        COMM.add(started, tensor)
        return tensor


WHOLE = PipelineStage()
_building = WHOLE


def current_stage() -> PipelineStage:
    """The stage the model being constructed now is for."""
    return _building


@contextmanager
def building_stage(stage: PipelineStage) -> Iterator[None]:
    global _building
    previous, _building = _building, stage
    try:
        yield
    finally:
        _building = previous


def layer_weights(config: ModelConfig) -> int:
    """One decoder layer's weights (attention and a gated MLP), as a measure of its cost per token."""
    attention = config.hidden_size * config.head_dim * 2 * (config.num_heads + config.num_kv_heads)
    return attention + 3 * config.hidden_size * config.intermediate_size


def partition_layers(config: ModelConfig, stages: int, counts: tuple[int, ...] | None = None) -> list[range]:
    """Contiguous layer ranges, at least one layer each: `counts` layers per stage when given, else
    minimising the heaviest stage's weights with the LM head counted in the last one (right for
    decode; a prompt's tokens skip the head but for the last row, so prefill-heavy loads of a model
    with a large head may prefer an even split, e.g. `counts` (9, 9) for an 18-layer model)."""
    n = config.num_layers
    if not 1 <= stages <= n:
        raise ValueError(
            f"a pipeline-parallel size of {stages} needs at least one layer per stage; this model has {n} layers"
        )
    if counts is not None:
        if len(counts) != stages or sum(counts) != n or min(counts) < 1:
            raise ValueError(
                f"pipeline layers {','.join(map(str, counts))}: give {stages} counts of at least 1 that add up "
                f"to the model's {n} layers"
            )
        return [range(end - count, end) for end, count in zip(accumulate(counts), counts, strict=True)]
    layer = layer_weights(config)
    head = config.vocab_size * config.hidden_size
    costs = [layer] * n
    costs[-1] += head
    return _balanced_ranges(costs, stages)


def _balanced_ranges(costs: list[int], parts: int) -> list[range]:
    """Split `costs` into `parts` non-empty contiguous runs minimising the largest run's sum (exact:
    dynamic programming over the split points; layers number in the tens)."""
    n = len(costs)
    prefix = [0, *accumulate(costs)]
    # best[k][i]: the smallest possible heaviest run splitting the first i costs into k runs.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                heaviest = max(best[k - 1][j], prefix[i] - prefix[j])
                if heaviest < best[k][i]:
                    best[k][i], cut[k][i] = heaviest, j
    ranges, end = [], n
    for k in range(parts, 0, -1):
        start = cut[k][end]
        ranges.append(range(start, end))
        end = start
    return ranges[::-1]
