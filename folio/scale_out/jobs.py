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
        if isinstance(exc, EngineDeadError):
            return cls("dead", str(exc))
        if isinstance(exc, ValueError):
            return cls("invalid", str(exc))
        return cls("failed", str(exc))

    def as_exception(self) -> Exception:
        if self.kind == "dead":
            return EngineDeadError(self.message)
        if self.kind == "invalid":
            return ValueError(self.message)
        return RequestFailedError(self.message)


@dataclass(frozen=True)
class ReplicaDescription:
    """What the ingress needs to know of the replicas' engine before serving."""

    max_model_len: int
    block_size: int
    max_num_seqs: int
