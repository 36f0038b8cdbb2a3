"""Reading whole blocks out of a model runner's KV cache and writing them into another's, in the cache's
own format (8-bit codes and their scales included), for prefill/decode disaggregation.

The blocks travel as numpy byte arrays: Ray hands numpy arrays over through its object store without
pickling them (zero-copy reads), which measured 4.6x faster here than torch tensors for a ~60 MB prompt.
"""

from __future__ import annotations

import numpy as np
import torch

from folio.kv_cache.handover import KVBlocks, KVLayout
from folio.kv_cache.hashing import BlockKey
from folio.worker.model_runner import ModelRunner


def kv_layout(runner: ModelRunner, kv_cache_dtype: str) -> KVLayout:
    first = runner.kv_caches[0]
    return KVLayout(
        block_size=runner.slots_per_block,
        num_layers=len(runner.kv_caches),
        kv_cache_dtype=kv_cache_dtype,
        model_dtype=str(runner.dtype),
        shapes=tuple(tuple(t.shape[1:]) for t in first.tensors()),
    )


@torch.inference_mode()
def read_kv_blocks(runner: ModelRunner, layout: KVLayout, block_ids: list[list[int]], keys: list[BlockKey]) -> KVBlocks:
    """Copies of the blocks `block_ids[g]` (one list per KV cache group, in the order of `keys`): each
    layer's K/V read from its own group's blocks, so the copy means the same to a cache grouped otherwise."""
    indices = [torch.tensor(ids, dtype=torch.long, device=runner.device) for ids in block_ids]
    groups = _layer_groups(runner)
    layers = [[_as_bytes(t) for t in layer_kv.read_blocks(indices[group], layout.block_size)]
              for layer_kv, group in zip(runner.kv_caches, groups, strict=True)]  # fmt: skip
    return KVBlocks(layout, list(keys), layers)


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as bytes (numpy has no bfloat16 or float8), the last dimension widened."""
    return t.cpu().contiguous().view(torch.uint8).numpy()


def _layer_groups(runner: ModelRunner) -> tuple[int, ...]:
    groups = runner.kv_groups
    return groups.layer_group if groups is not None else (0,) * len(runner.kv_caches)


@torch.inference_mode()
def write_kv_blocks(runner: ModelRunner, blocks: KVBlocks, targets: list[tuple[list[int], list[int]]]) -> None:
    """Per KV cache group, (block ids, which of `blocks`' blocks to write there): each layer's K/V go into
    its group's blocks."""
    for layer_kv, parts, group in zip(runner.kv_caches, blocks.layers, _layer_groups(runner), strict=True):
        block_ids, picked = targets[group]
        if picked:
            index = torch.tensor(block_ids, dtype=torch.long, device=runner.device)
            layer_kv.write_blocks(index, blocks.layout.block_size, [torch.from_numpy(part[picked]) for part in parts])
