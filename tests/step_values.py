"""What a runner would hold, rebuilt from SchedulerOutputs alone: lets scheduler tests check the block
table deltas against the KV manager's tables."""

from __future__ import annotations

from folio.step import SchedulerOutput


class SentTables:
    def __init__(self) -> None:
        self.tables: dict[str, list[list[int]]] = {}  # per request, one table per KV cache group

    def apply(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_request_ids:
            self.tables.pop(request_id, None)
        for chunk in out.scheduled:
            tables = self.tables.setdefault(chunk.request_id, [[] for _ in chunk.new_block_ids])
            for table, ids in zip(tables, chunk.new_block_ids, strict=True):
                table[chunk.first_new_block :] = ids

    def __getitem__(self, request_id: str) -> list[int]:
        """The first group's table."""
        return self.tables[request_id][0]

    def tables_of(self, request_id: str) -> list[list[int]]:
        return self.tables[request_id]
