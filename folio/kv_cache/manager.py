"""Maps requests to block tables and grows them as their sequences grow."""

from __future__ import annotations

from folio.kv_cache.block_pool import BlockPool


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request_id: str, total_tokens: int) -> bool:
        """Make room for `total_tokens` tokens of KV; False (and nothing changed) if the pool is short."""
        table = self.block_tables.setdefault(request_id, [])
        missing = self.blocks_needed(total_tokens) - len(table)
        if missing <= 0:
            return True
        if missing > self.pool.num_free_blocks:
            if not table:
                del self.block_tables[request_id]
            return False
        table.extend(self.pool.allocate(missing))
        return True

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        if table:
            self.pool.free(table)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]
