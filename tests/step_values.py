"""What a runner would hold, rebuilt from SchedulerOutputs alone: lets scheduler tests check the block
table deltas against the KV manager's tables."""

from __future__ import annotations

from folio.step.scheduler_output import SchedulerOutput


class SentTables:
    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}

    def apply(self, out: SchedulerOutput) -> None:
        for request_id in out.finished_request_ids:
            self.tables.pop(request_id, None)
        for chunk in out.scheduled:
            self.tables.setdefault(chunk.request_id, [])[chunk.first_new_block :] = chunk.new_block_ids

    def __getitem__(self, request_id: str) -> list[int]:
        return self.tables[request_id]
