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

from folio.engine.engine_core import EngineCore
from folio.kv_cache.handover import KVBlocks
from folio.kv_cache.hashing import BlockKey, extend_block_keys
from folio.worker.kv_block_io import kv_layout, read_kv_blocks, write_kv_blocks
from folio.worker.model_runner import ModelRunner


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
    for count, key in enumerate(keys):
        if _cached(core, key) is None:
            return count
    return len(keys)


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
    if blocks.layout != kv_layout(runner, core.kv_cache_dtype):
        raise ValueError(f"these KV blocks were written by another cache layout ({blocks.layout}); this engine's "
                         f"is {kv_layout(runner, core.kv_cache_dtype)}")  # fmt: skip
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
