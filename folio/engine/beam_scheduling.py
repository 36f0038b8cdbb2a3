"""How the scheduler runs beam searches (beam_group.py): beams are ordinary requests that park after
reporting their candidates; these methods fork, drop, fail and finish them. Mixed into `Scheduler`,
whose state they share."""

from __future__ import annotations

from typing import TYPE_CHECKING

from folio.engine.beam_group import BeamGroup, advance
from folio.engine.request import FinishReason, Request, RequestStatus

if TYPE_CHECKING:
    from folio.engine.batching import BatchGate
    from folio.kv_cache.manager import KVCacheManager


class BeamScheduling:
    _beam_groups: dict[str, BeamGroup]
    requests: dict[str, Request]
    running: list[Request]
    gate: BatchGate
    kv: KVCacheManager

    if TYPE_CHECKING:  # the Scheduler's own

        def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Request | None: ...

        def _enqueue(self, request: Request) -> None: ...

    def _abort_beam_result(self, result_id: str, reason: FinishReason) -> Request:
        """A caller gave up on one result of a beam search; the search stops with the last one."""
        group = self._beam_groups.pop(result_id)
        result = next(r for r in group.results if r.request_id == result_id)
        group.results.remove(result)
        result.finish(reason)
        if not group.results:
            for beam in group.beams:
                self.abort_request(beam.request_id)
        return result

    def _is_parked(self, request: Request) -> bool:
        """A beam that reported its candidates and waits for its siblings to report theirs."""
        group = self._beam_groups.get(request.request_id)
        return group is not None and request.request_id in group.pending

    def _num_beam_candidates(self, request: Request) -> int:
        group = self._beam_groups.get(request.request_id)
        return 0 if group is None else group.search.num_candidates

    def _advance_beams(self, group: BeamGroup, now: float) -> list[Request]:
        """Every live beam reported: pick the next beams; return the results if the search ended."""
        step = advance(group, now, self._fork_beam)
        for beam in step.dropped:
            self.abort_request(beam.request_id)
        for result in step.finished:
            self._beam_groups.pop(result.request_id, None)
        return step.finished

    def _fork_beam(self, parent: Request, child: Request) -> None:
        """A new beam continues `parent`: it holds the parent's blocks if it has any, else it queues."""
        self.requests[child.request_id] = child
        self._beam_groups[child.request_id] = self._beam_groups[parent.request_id]
        self.gate.join(child.request_id)
        if parent.status is RequestStatus.RUNNING:
            self.kv.fork(parent.request_id, child.request_id)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        else:
            self._enqueue(child)

    def _fail_beam_group(self, group: BeamGroup, error: str, now: float) -> list[Request]:
        """A beam's row failed: the whole search ends with the error, its beams freed."""
        for beam in list(group.beams):
            self.abort_request(beam.request_id)
        for result in group.results:
            self._beam_groups.pop(result.request_id, None)
            result.fail(error, now)
        return list(group.results)
