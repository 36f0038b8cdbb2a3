"""Prefix-cache counters of the server, scraped from its Prometheus `/metrics` before and after each rate (and
folio's KV hand-over and KV tier counters likewise).

folio exposes `folio:prefix_cache_queries_total` and `folio:prefix_cache_hits_total` (prompt tokens looked up
in the prefix cache, and those whose KV came from it); vLLM the same under `vllm:`. The difference over a rate
is what that rate's requests queried and hit, provided nothing else uses the server meanwhile. A server
without them (llama-server, or no /metrics at all) is "not reported", never an error.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from folio_tools.bench.serve.client import request_headers

NOT_REPORTED = "not reported"
_PREFIXES = ("folio", "vllm")  # namespaces whose prefix_cache_* counters count tokens
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{.*\})?\s+(\S+)")

Counters = tuple[float, float]  # (queried tokens, hit tokens) since the server started


def parse_prefix_cache(text: str) -> Counters | None:
    """The queries and hits counters of a Prometheus text exposition, summed over their label sets; None
    unless both are there."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue  # comments (# HELP, # TYPE) and blank lines
        name, value = match.groups()
        namespace, _, metric = name.partition(":")
        if namespace in _PREFIXES and metric in ("prefix_cache_queries_total", "prefix_cache_hits_total"):
            try:
                sums[metric] = sums.get(metric, 0.0) + float(value)
            except ValueError:
                return None
    if len(sums) != 2:
        return None
    return sums["prefix_cache_queries_total"], sums["prefix_cache_hits_total"]


KV_TRANSFER = ("folio:kv_transfer_blocks_total", "folio:kv_transfer_bytes_total", "folio:kv_transfer_seconds_sum",
               "folio:kv_transfer_seconds_count")  # fmt: skip


# The KV tiers under folio's pool (--kv-offload-ram, --kv-cache-dir): what each rate moved and how long it took.
KV_TIERS = {
    "ram_stored_blocks": "folio:kv_offload_ram_stored_blocks_total",
    "ram_loaded_blocks": "folio:kv_offload_ram_loaded_blocks_total",
    "disk_stored_blocks": "folio:kv_cache_disk_stored_blocks_total",
    "disk_loaded_blocks": "folio:kv_cache_disk_loaded_blocks_total",
    "disk_failed_loads": "folio:kv_cache_disk_failed_loads_total",
    "disk_written_bytes": "folio:kv_cache_disk_written_bytes_total",
    "disk_read_bytes": "folio:kv_cache_disk_read_bytes_total",
    "disk_save_seconds": "folio:kv_cache_disk_save_seconds_total",
    "disk_load_seconds": "folio:kv_cache_disk_load_seconds_total",
}


def _sums(text: str, names: tuple[str, ...]) -> tuple[float, ...] | None:
    """The named samples of a Prometheus text exposition, each summed over its label sets (and replicas);
    None when none of them is there."""
    sums = dict.fromkeys(names, 0.0)
    seen = False
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is not None and match.group(1) in sums:
            sums[match.group(1)] += float(match.group(2))
            seen = True
    return tuple(sums.values()) if seen else None


def parse_kv_transfer(text: str) -> tuple[float, ...] | None:
    """A disaggregated folio server's KV hand-over counters (blocks, bytes, seconds, hand-overs), summed over
    its decode replicas; None when it has none."""
    return _sums(text, KV_TRANSFER)


def parse_kv_tiers(text: str) -> tuple[float, ...] | None:
    """folio's KV tier counters, in KV_TIERS order; None from a server without them."""
    return _sums(text, tuple(KV_TIERS.values()))


def _scrape(base_url: str, parse: Callable[[str], tuple[float, ...] | None], timeout_s: float = 10.0
            ) -> tuple[float, ...] | None:  # fmt: skip
    import httpx

    try:
        response = httpx.get(f"{base_url}/metrics", headers=request_headers(), timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return parse(response.text) if response.status_code == 200 else None


def scrape_kv_transfer(base_url: str, timeout_s: float = 10.0) -> tuple[float, ...] | None:
    return _scrape(base_url, parse_kv_transfer, timeout_s)


def scrape_kv_tiers(base_url: str, timeout_s: float = 10.0) -> tuple[float, ...] | None:
    return _scrape(base_url, parse_kv_tiers, timeout_s)


def kv_tiers_delta(before: tuple[float, ...] | None, after: tuple[float, ...] | None) -> dict[str, Any] | None:
    """What one rate moved through the KV tiers, with the mean time per block the disk's I/O thread took to
    write and to read (and check) one; None when the server has no tiers or they moved nothing."""
    if before is None or after is None:
        return None
    delta = {name: a - b for name, a, b in zip(KV_TIERS, after, before, strict=True)}
    if not any(delta.values()):
        return None
    counts = {name: round(value) for name, value in delta.items() if not name.endswith("_seconds")}
    stored, loaded = counts["disk_stored_blocks"], counts["disk_loaded_blocks"]
    return counts | {
        "disk_save_ms_per_block": 1000 * delta["disk_save_seconds"] / stored if stored else None,
        "disk_load_ms_per_block": 1000 * delta["disk_load_seconds"] / loaded if loaded else None,
    }


def kv_transfer_delta(before: tuple[float, ...] | None, after: tuple[float, ...] | None) -> dict[str, Any] | None:
    """What one rate handed over between prefill and decode replicas, and the mean time per hand-over (the
    prefill's compute excluded); None for a server that does not disaggregate."""
    if before is None or after is None:
        return None
    blocks, nbytes, seconds, count = (a - b for a, b in zip(after, before, strict=True))
    return {
        "blocks": round(blocks),
        "bytes": round(nbytes),
        "handovers": round(count),
        "seconds": seconds,
        "mean_ms": 1000 * seconds / count if count else None,
        "ms_per_mb": 1000 * seconds / (nbytes / 2**20) if nbytes else None,
    }


def scrape_prefix_cache(base_url: str, timeout_s: float = 10.0) -> Counters | None:
    """The server's counters now, or None when it has no /metrics or no prefix-cache counters there."""
    return _scrape(base_url, parse_prefix_cache, timeout_s)  # type: ignore[return-value]


def prefix_cache_delta(before: Counters | None, after: Counters | None) -> dict[str, Any] | str:
    """What one rate queried and hit, in tokens, and the hit rate (None when nothing was queried)."""
    if before is None or after is None:
        return NOT_REPORTED
    queried, hits = after[0] - before[0], after[1] - before[1]
    return {
        "queried_tokens": round(queried),
        "hit_tokens": round(hits),
        "hit_rate": hits / queried if queried else None,
    }


def hit_rate(summary: dict[str, Any]) -> float | None:
    """A rate's prefix-cache hit rate, None when the server did not report one."""
    cache = summary.get("prefix_cache")
    return cache.get("hit_rate") if isinstance(cache, dict) else None
