"""A disaggregated server's KV hand-over counters, as `folio bench serve` reads them from /metrics."""

from __future__ import annotations

import pytest
from folio_tools.bench.serve.metrics import kv_transfer_delta, parse_kv_transfer


def test_kv_hand_over_counters_are_summed_over_decode_replicas():
    text = """# TYPE folio:kv_transfer_blocks_total counter
folio:kv_transfer_blocks_total{replica="p",role="prefill"} 0.0
folio:kv_transfer_blocks_total{replica="d1",role="decode"} 10.0
folio:kv_transfer_blocks_total{replica="d2",role="decode"} 6.0
folio:kv_transfer_bytes_total{replica="d1",role="decode"} 2097152.0
folio:kv_transfer_seconds_sum{replica="d1",role="decode"} 0.5
folio:kv_transfer_seconds_count{replica="d1",role="decode"} 4.0
"""
    before = parse_kv_transfer(text)
    assert before == (16.0, 2097152.0, 0.5, 4.0)
    assert parse_kv_transfer("folio:prefix_cache_hits_total 3\n") is None  # not disaggregated
    after = (26.0, 4194304.0, 0.7, 6.0)
    delta = kv_transfer_delta(before, after)
    assert delta is not None and (delta["blocks"], delta["bytes"], delta["handovers"]) == (10, 2097152, 2)
    assert delta["mean_ms"] == pytest.approx(100.0) and delta["ms_per_mb"] == pytest.approx(100.0)
    assert kv_transfer_delta(None, after) is None
