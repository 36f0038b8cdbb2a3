"""Prefill/decode disaggregation, engine side: hand a prompt's computed KV blocks from one engine to
another through the prefix cache.

The prefill engine computes the prompt, then `export_prefix` copies the blocks its prefix cache now
holds for it (full blocks only, by their hash-chain keys). The decode engine `import_prefix`es them:
each block it does not hold yet is allocated, written, registered under its key and freed onto the
prefix cache's LRU list, exactly as if it had computed and finished a request with that prompt. The
request itself is then added as usual: it hits those blocks and computes only the rest (at least the
last prompt token, for logits), so what it generates is what the decode engine would have generated
had it computed the whole prompt itself and cached it. A block missing on either side is recomputed,
never wrong. Both run on the engine thread, between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from folio.engine.engine_core import EngineCore
from folio.kv_cache.hashing import BlockKey, extend_block_keys
from folio.worker.model_runner import ModelRunner


@dataclass(frozen=True)
class KVLayout:
    """What two caches must share for one's blocks to mean the same in the other."""

    block_size: int
    num_layers: int
    kv_cache_dtype: str  # "auto" (the model's dtype), "int8" or "fp8"
    model_dtype: str
    shapes: tuple[tuple[int, ...], ...]  # one layer's per-slot tensor shapes: K, V (and scales)


@dataclass
class KVBlocks:
    """Whole KV blocks of a prompt's prefix, as the value one engine hands another: each block named by
    its prefix-cache key, its K/V in the cache's own format (8-bit codes and their scales included)."""

    layout: KVLayout
    keys: list[BlockKey]  # the blocks' identities, in prompt order
    # Per layer: K, V (and scales), each [n, B, ...] as raw bytes (numpy: Ray's object store reads it in place).
    layers: list[list[np.ndarray]] = field(default_factory=list)
    compute_seconds: float = 0.0  # what computing the prompt took the sender (the rest of a hand-over is transfer)

    @property
    def num_blocks(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for parts in self.layers for part in parts)


def _runner(core: EngineCore) -> ModelRunner:
    if not isinstance(core.runner, ModelRunner):
        raise ValueError("handing KV blocks between engines needs whole-model engines (no tensor, pipeline or "
                         "context parallelism)")  # fmt: skip
    return core.runner


def prompt_keys(core: EngineCore, token_ids: list[int], cache_salt: str | None) -> list[BlockKey]:
    """The keys of the prompt's full blocks a request would look up (never the block holding the last token,
    which is always recomputed)."""
    keys: list[BlockKey] = []
    usable = (len(token_ids) - 1) // core.kv.block_size * core.kv.block_size
    extend_block_keys(keys, token_ids[:usable], core.kv.block_size, cache_salt)
    return keys


def _cached(core: EngineCore, key: BlockKey) -> list[int] | None:
    """The block holding `key` in each KV cache group, or None if some group lacks it."""
    found = [core.kv.pool.lookup(key, group) for group in range(core.kv.num_groups)]
    return None if None in found else found  # type: ignore[return-value]


def held_prefix(core: EngineCore, keys: list[BlockKey]) -> int:
    """How many of `keys`, from the first, this engine's prefix cache holds (in every KV cache group)."""
    return next((count for count, key in enumerate(keys) if _cached(core, key) is None), len(keys))


def export_prefix(core: EngineCore, keys: list[BlockKey], skip: int = 0) -> KVBlocks:
    """Copies of the cached blocks for `keys[skip:]`, up to the first one not cached."""
    block_ids: list[list[int]] = [[] for _ in range(core.kv.num_groups)]
    exported = []
    for key in keys[skip:]:
        found = _cached(core, key)
        if found is None:
            break
        for ids, block in zip(block_ids, found, strict=True):
            ids.append(block)
        exported.append(key)
    runner = _runner(core)
    return read_kv_blocks(runner, kv_layout(runner, core.kv_cache_dtype), block_ids, exported)


def import_prefix(core: EngineCore, blocks: KVBlocks) -> int:
    """Put `blocks` into this engine's prefix cache; returns how many were new to it (in some KV cache
    group). Blocks already held are skipped; when the pool is short, the tail of the prefix is dropped
    (recomputed later)."""
    runner = _runner(core)
    if blocks.layout != (layout := kv_layout(runner, core.kv_cache_dtype)):
        raise ValueError(f"these KV blocks were written by another cache layout ({blocks.layout}); this engine's "
                         f"is {layout}")  # fmt: skip
    if not core.kv.enable_prefix_caching:
        return 0
    pool = core.kv.pool
    num_groups = core.kv.num_groups
    placed: list[tuple[int, int]] = []  # (index in blocks.keys, block): taken so allocating cannot evict them
    wanted: list[list[int]] = [[] for _ in range(num_groups)]  # per group, the keys it lacks, in prompt order
    try:
        reserved = 0
        for i, key in enumerate(blocks.keys):
            found = [pool.lookup(key, group) for group in range(num_groups)]
            for block in found:
                if block is not None:
                    pool.touch(block)
                    placed.append((i, block))
            lacking = [group for group, block in enumerate(found) if block is None]
            if len(lacking) > pool.num_free_blocks - reserved:
                break  # the prefix's tail is recomputed later
            for group in lacking:
                wanted[group].append(i)
            reserved += len(lacking)
        targets = [(pool.allocate(len(picked)), picked) for picked in wanted]
        runner.run_tier_ops(core.kv.take_tier_ops())  # evicted blocks are saved before they are written over
        for fresh, picked in targets:
            placed.extend(zip(picked, fresh, strict=True))
        write_kv_blocks(runner, blocks, targets)
        for group, (fresh, picked) in enumerate(targets):
            for i, block in zip(picked, fresh, strict=True):
                pool.register(block, blocks.keys[i], group)
        return len({i for picked in wanted for i in picked})
    finally:
        # Back onto the LRU list, still cached; freed in prompt order, so the first blocks go last.
        pool.free([block for _, block in sorted(placed)])


# Reading whole blocks out of a runner's KV cache and writing them into another's.
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
