"""The arithmetic of `folio bench serve`: per-request records in, latency percentiles, throughput,
goodput and cost out. Pure functions over plain numbers, so they can be checked by hand."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99)
SLO_METRICS = ("ttft", "tpot", "e2e")
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(ms|s)\s*$", re.IGNORECASE)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds; `start_s` counts from the start of the run."""

    index: int
    prompt_len: int  # prompt tokens as the benchmark's tokenizer counts them
    output_len: int  # max_tokens asked for
    start_s: float = 0.0
    success: bool = False
    status: int | None = None  # HTTP status, None when no response came
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    output_tokens_source: str = "chunks"  # "usage" (the server's final usage chunk) or "chunks" (counted)
    prompt_tokens: int | None = None  # the server's usage.prompt_tokens, when it sent usage
    cached_tokens: int | None = None  # of those, usage.prompt_tokens_details.cached_tokens: taken from its cache
    finish_reason: str | None = None
    conversation: int | None = None  # multi-turn: the conversation and the turn in it (from 0)
    turn: int | None = None
    server_timings: dict[str, Any] | None = None  # llama-server's `timings` of the last chunk that had them

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None below two tokens."""
        if not self.success or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        record = {**asdict(self), "tpot_s": self.tpot_s}
        if self.conversation is None:  # single requests: keep the file free of two nulls per request
            del record["conversation"], record["turn"]
        if self.server_timings is None:  # only llama-server sends them
            del record["server_timings"]
        return record


def parse_duration(text: str) -> float:
    """`200ms`, `1.5s` -> seconds."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration like 200ms or 1.5s")
    value = float(match.group(1))
    return value / 1000 if match.group(2).lower() == "ms" else value


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft=200ms,tpot=100ms,e2e=2s` -> {"ttft": 0.2, "tpot": 0.1, "e2e": 2.0} (seconds)."""
    slo: dict[str, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_METRICS:
            raise ValueError(f"--slo {text!r}: each item must be METRIC=DURATION with METRIC one of ttft, tpot, e2e")
        try:
            slo[key] = parse_duration(value)
        except ValueError as exc:
            raise ValueError(f"--slo {text!r}: {exc}") from None
    return slo


def distribution(values: list[float], scale: float = 1000.0) -> dict[str, float] | None:
    """Mean, std and percentiles (linear interpolation) of `values` times `scale` (seconds -> ms by
    default); None for no values."""
    if not values:
        return None
    array = np.asarray(values, dtype=np.float64) * scale
    stats = {"mean": float(array.mean()), "std": float(array.std())}
    stats.update({f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES})
    stats.update({"min": float(array.min()), "max": float(array.max())})
    return stats


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """A successful request meets the SLO when each bound given holds; a one-token answer has no TPOT
    and meets any TPOT bound."""
    if not record.success:
        return False
    values = {"ttft": record.ttft_s, "tpot": record.tpot_s or 0.0, "e2e": record.e2e_s}
    return all(values[key] is not None and values[key] <= bound for key, bound in slo.items())


def cost_per_million_output_tokens(price_per_hour: float | None, output_tokens_per_s: float) -> float | None:
    """Dollars per 1M output tokens when the server costs `price_per_hour` and sustains this throughput."""
    if price_per_hour is None or output_tokens_per_s <= 0:
        return None
    return price_per_hour / (output_tokens_per_s * 3600) * 1e6


def summarize(
    records: list[RequestRecord], duration_s: float, slo: dict[str, float], price_per_hour: float | None = None
) -> dict[str, Any]:
    """The aggregate of one run: counts, throughputs over `duration_s`, goodput, cost, and latency
    distributions in milliseconds (ITL pools the gaps of every request)."""
    done = [r for r in records if r.success]
    output_tokens = sum(r.output_tokens for r in done)
    server_counts = all(r.prompt_tokens is not None for r in done)
    prompt_tokens = sum((r.prompt_tokens if server_counts else r.prompt_len) or 0 for r in done)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    output_per_s = per_s(output_tokens)
    sources = sorted({r.output_tokens_source for r in done})
    errors: dict[str, int] = {}
    for r in records:
        if not r.success:
            errors[r.error or "unknown error"] = errors.get(r.error or "unknown error", 0) + 1
    good = sum(meets_slo(r, slo) for r in done) if slo else None
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": errors,
        "duration_s": duration_s,
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_source": "usage" if server_counts and done else "client",
        "output_tokens": output_tokens,
        "output_tokens_source": "+".join(sources) if sources else None,
        "requested_output_tokens": sum(r.output_len for r in done),
        "requests_per_s": per_s(len(done)),
        "output_tokens_per_s": output_per_s,
        "total_tokens_per_s": per_s(prompt_tokens + output_tokens),
        "slo": {key: value * 1000 for key, value in slo.items()},  # ms
        "good_requests": good,
        "goodput_requests_per_s": None if good is None else per_s(good),
        "cost_per_1m_output_tokens": cost_per_million_output_tokens(price_per_hour, output_per_s),
        "ttft_ms": distribution([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": distribution([t for r in done if (t := r.tpot_s) is not None]),
        "itl_ms": distribution([gap for r in done for gap in r.itl_s]),
        "e2e_ms": distribution([r.e2e_s for r in done if r.e2e_s is not None]),
    }


def format_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _round_gaps(value: Any, digits: int = 6) -> Any:
    """Floats inside lists (the per-token gaps of every request) rounded to microseconds: they would
    otherwise dominate the file with 17-digit floats. Summary values are left exact."""
    if isinstance(value, dict):
        return {k: _round_gaps(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [round(v, digits) if isinstance(v, float) else _round_gaps(v, digits) for v in value]
    return value


def dump_json(value: Any) -> str:
    """Indented JSON, except that lists of numbers (per-token gaps) stay on one line."""
    text = json.dumps(_round_gaps(value), indent=1)
    return re.sub(r"\[\s+([-0-9.e,\s]+?)\s+\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text) + "\n"
