"""The scheduler's record of what the model runner holds, so that each step sends only what changed.

The runner is sent a request's data once (`NewRequestData`), then per step its chunk's tokens and the
part of its block tables that changed since it last saw it; a request that ends is named once in
`finished_request_ids`, so the runner drops what it kept. Preemption keeps the runner's state (its
seeded generator goes on where it stopped) but resends the block table whole.
"""

from __future__ import annotations

from folio.engine.request import Request
from folio.step import NewRequestData


class RunnerView:
    def __init__(self) -> None:
        self._known: set[str] = set()  # requests the runner holds data for
        self._sent_tables: dict[str, list[list[int]]] = {}  # each one's block tables as last sent
        self._finished: set[str] = set()  # ended since the last step

    def new_request_data(self, request: Request) -> NewRequestData | None:
        """The request's data if the runner has not met it yet (then it has)."""
        if request.request_id in self._known:
            return None
        self._known.add(request.request_id)
        return NewRequestData(request.request_id, tuple(request.prompt_token_ids), tuple(request.output_token_ids),
                              request.sampling_params, request.lora_name)  # fmt: skip

    def block_changes(self, request_id: str, tables: list[list[int]]) -> tuple[int, tuple[tuple[int, ...], ...]]:
        """The first index where any group's table differs from what the runner holds, and each group's
        ids from there on."""
        sent = self._sent_tables.get(request_id)
        first = len(sent[0]) if sent else 0
        if sent:
            for table, old in zip(tables, sent, strict=True):
                if table[:first] != old[:first]:
                    differs = (i for i, (a, b) in enumerate(zip(table, old, strict=False)) if a != b)
                    first = min(first, next(differs, first))
        first = min(first, len(tables[0]))
        self._sent_tables[request_id] = [list(table) for table in tables]
        return first, tuple(tuple(table[first:]) for table in tables)

    def preempted(self, request_id: str) -> None:
        """Its blocks were freed: it comes back with a new table, sent whole."""
        self._sent_tables.pop(request_id, None)

    def finished(self, request_id: str) -> None:
        """The request ended: the runner drops what it holds for it at the next step."""
        self._sent_tables.pop(request_id, None)
        if request_id in self._known:
            self._known.discard(request_id)
            self._finished.add(request_id)

    def take_finished(self) -> frozenset[str]:
        finished, self._finished = frozenset(self._finished), set()
        return finished
