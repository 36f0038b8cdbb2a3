"""A disaggregated server's KV hand-over counters and the KV tiers' counters, as `folio bench serve` reads them
from /metrics."""

from __future__ import annotations

import pytest
from folio_tools.bench.serve.metrics import (
    KV_TIERS,
    kv_tiers_delta,
    kv_transfer_delta,
    parse_kv_tiers,
    parse_kv_transfer,
)


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


def test_kv_tier_counters_give_what_a_rate_moved_and_the_disks_time_per_block():
    names = list(KV_TIERS.values())
    before = parse_kv_tiers("\n".join(f"{name} 0.0" for name in names) + "\n")
    assert before == (0.0,) * len(names)
    assert kv_tiers_delta(before, before) is None  # tiers that moved nothing say nothing
    assert parse_kv_tiers("folio:prefix_cache_hits_total 3\n") is None  # a server without tiers
    values = {"ram_loaded_blocks": 12, "disk_stored_blocks": 4, "disk_loaded_blocks": 8, "disk_save_seconds": 0.002,
              "disk_load_seconds": 0.004, "disk_read_bytes": 8192}  # fmt: skip
    after = tuple(float(values.get(key, 0)) for key in KV_TIERS)
    delta = kv_tiers_delta(before, after)
    assert delta is not None and (delta["ram_loaded_blocks"], delta["disk_loaded_blocks"]) == (12, 8)
    assert delta["disk_save_ms_per_block"] == pytest.approx(0.5)
    assert delta["disk_load_ms_per_block"] == pytest.approx(0.5)
    assert delta["disk_read_bytes"] == 8192 and delta["disk_failed_loads"] == 0
