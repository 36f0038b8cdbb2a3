"""Request bodies of the OpenAI-compatible API, validated by pydantic (out-of-range values -> 400)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class CompletionRequest(BaseModel):
    # Unknown fields are refused, never silently ignored.
    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str | list[str] | list[int]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stream: bool = False
    ignore_eos: bool = False
    user: str | None = None
