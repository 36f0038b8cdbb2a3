"""`folio bench serve` statistics checked against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
from folio_tools.bench.serve.stats import (
    RequestRecord,
    cost_per_million_output_tokens,
    distribution,
    meets_slo,
    parse_duration,
    parse_slo,
    summarize,
)

# -- statistics, by hand ------------------------------------------------------------------------------


def _record(i, ttft, e2e, tokens, itl=(), prompt=None, success=True, error=None) -> RequestRecord:
    return RequestRecord(i, prompt_len=10, output_len=tokens, success=success, error=error, ttft_s=ttft, e2e_s=e2e,
                         itl_s=list(itl), output_tokens=tokens, prompt_tokens=prompt)  # fmt: skip


def test_durations_and_slo_parsing():
    assert parse_duration("200ms") == pytest.approx(0.2) and parse_duration("1.5s") == 1.5
    assert parse_duration(" 2S ") == 2.0 and parse_duration("1e3ms") == pytest.approx(1.0)
    assert parse_slo("ttft=200ms, tpot=0.1s,e2e=2s") == pytest.approx({"ttft": 0.2, "tpot": 0.1, "e2e": 2.0})
    assert parse_slo(None) == {} and parse_slo("") == {}
    for bad in ("ttft", "ttft=fast", "itl=5ms", "ttft=-1ms"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_distribution_by_hand():
    # 1, 2, 3, 4 s -> ms. Linear interpolation: p50 = 2.5; p90 at rank 2.7 -> 3 + 0.7 = 3.7;
    # p95 at rank 2.85 -> 3.85; p99 at rank 2.97 -> 3.97. Mean 2.5, population std sqrt(1.25).
    stats = distribution([4.0, 1.0, 3.0, 2.0])
    assert stats == pytest.approx({"mean": 2500, "std": 1000 * math.sqrt(1.25), "p50": 2500, "p90": 3700,
                                   "p95": 3850, "p99": 3970, "min": 1000, "max": 4000})  # fmt: skip
    assert distribution([]) is None
    single = dict.fromkeys(("mean", "p50", "p90", "p95", "p99", "min", "max"), 250.0) | {"std": 0.0}
    assert distribution([0.25]) == pytest.approx(single)


def test_tpot_and_slo_by_hand():
    record = _record(0, ttft=0.5, e2e=2.5, tokens=5)
    assert record.tpot_s == pytest.approx(0.5)  # (2.5 - 0.5) / (5 - 1)
    assert _record(1, ttft=0.5, e2e=0.5, tokens=1).tpot_s is None
    assert meets_slo(record, {"ttft": 0.5, "tpot": 0.5, "e2e": 2.5})  # bounds are inclusive
    assert not meets_slo(record, {"tpot": 0.49})
    assert meets_slo(_record(1, ttft=0.5, e2e=0.5, tokens=1), {"tpot": 0.001})  # no TPOT to miss
    assert not meets_slo(_record(2, None, None, 0, success=False, error="x"), {})


def test_summary_by_hand():
    records = [
        _record(0, ttft=0.1, e2e=1.1, tokens=11, itl=[0.1] * 10, prompt=20),  # TPOT (1.1-0.1)/10 = 0.1
        _record(1, ttft=0.3, e2e=2.3, tokens=5, itl=[0.5] * 4, prompt=30),  # TPOT 2.0/4 = 0.5
        _record(2, ttft=0.2, e2e=0.2, tokens=1, prompt=10),  # no TPOT
        _record(3, ttft=None, e2e=None, tokens=0, success=False, error="HTTP 500: boom"),
    ]
    summary = summarize(records, duration_s=4.0, slo={"ttft": 0.25, "tpot": 0.2}, price_per_hour=3.6)
    assert (summary["completed"], summary["failed"], summary["errors"]) == (3, 1, {"HTTP 500: boom": 1})
    assert summary["output_tokens"] == 17 and summary["prompt_tokens"] == 60
    assert summary["prompt_tokens_source"] == "usage"
    assert summary["requests_per_s"] == pytest.approx(0.75)  # 3 / 4
    assert summary["output_tokens_per_s"] == pytest.approx(4.25)  # 17 / 4
    assert summary["total_tokens_per_s"] == pytest.approx(19.25)  # 77 / 4
    assert summary["good_requests"] == 2  # 0 and 2 (no TPOT); 1 misses both bounds
    assert summary["goodput_requests_per_s"] == pytest.approx(0.5)
    # $3.60/h at 4.25 tok/s: 15300 tokens an hour -> 3.6 / 15300 * 1e6 = 235.29...
    assert summary["cost_per_1m_output_tokens"] == pytest.approx(235.294117647)
    assert summary["ttft_ms"]["mean"] == pytest.approx(200) and summary["ttft_ms"]["p50"] == pytest.approx(200)
    assert summary["tpot_ms"]["mean"] == pytest.approx(300) and summary["tpot_ms"]["max"] == pytest.approx(500)
    assert summary["itl_ms"]["mean"] == pytest.approx((10 * 100 + 4 * 500) / 14)  # pooled over requests
    assert summary["e2e_ms"]["p50"] == pytest.approx(1100)
    assert summary["slo"] == pytest.approx({"ttft": 250, "tpot": 200})


def test_summary_edge_cases():
    # A request without usage counts its prompt on the client side; no SLO means no goodput; no price, no cost.
    mixed = [_record(0, 0.1, 0.2, 2, prompt=7), _record(1, 0.1, 0.2, 2, prompt=None)]
    summary = summarize(mixed, duration_s=2.0, slo={})
    assert summary["prompt_tokens_source"] == "client" and summary["prompt_tokens"] == 20
    assert summary["goodput_requests_per_s"] is None and summary["cost_per_1m_output_tokens"] is None
    failed = summarize([_record(0, None, None, 0, success=False)], duration_s=1.0, slo={"ttft": 1.0})
    assert failed["completed"] == 0 and failed["ttft_ms"] is None and failed["requests_per_s"] == 0
    assert failed["errors"] == {"unknown error": 1} and failed["goodput_requests_per_s"] == 0
    assert cost_per_million_output_tokens(2.0, 0.0) is None
    assert cost_per_million_output_tokens(2.0, 1000 / 3600) == pytest.approx(2000)  # 1000 tokens/h at $2/h
