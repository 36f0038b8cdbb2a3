"""The values that cross from the ingress to an engine replica and back (pickled by Ray).

One `EngineJob` is one prompt's samples of one API call; the replica streams back `(choice index,
RequestUpdate)` pairs, and ends with a `JobFailure` instead of raising, so the ingress turns a failure
into the same local exception `AsyncEngine` would have raised, whatever Ray wraps exceptions in.
"""

from __future__ import annotations

from dataclasses import dataclass

from folio.sampling_params import SamplingParams
from folio.server.engine_client.updates import EngineDeadError, RequestFailedError


@dataclass(frozen=True)
class EngineJob:
    prompt_token_ids: list[int]
    params: list[SamplingParams]  # one per sample; the first computes the prompt, the others fork from it
    cache_salt: str | None = None
    priority: int = 0
    first_index: int = 0  # the API call's choice index of the first sample


@dataclass(frozen=True)
class JobFailure:
    kind: str  # "invalid" (the engine refused the request), "failed" (it failed inside), "dead"
    message: str

    @classmethod
    def of(cls, exc: Exception) -> JobFailure:
        return cls(next((kind for kind, error in _ERRORS.items() if isinstance(exc, error)), "failed"), str(exc))

    def as_exception(self) -> Exception:
        return _ERRORS.get(self.kind, RequestFailedError)(self.message)


_ERRORS: dict[str, type[Exception]] = {"dead": EngineDeadError, "invalid": ValueError, "failed": RequestFailedError}


@dataclass(frozen=True)
class ReplicaDescription:
    """What the ingress needs to know of the replicas' engine before serving."""

    max_model_len: int
    block_size: int
    max_num_seqs: int
