"""The served half of `folio bench spec`: one `folio serve` per variant (folio_server.py), one at a time, each
sent every workload at every concurrency through the streaming client of `folio bench serve`
(serve_client.py: every request streamed, greedy, all sent at once with at most N in flight). The drafts of
each run are the difference of the server's /metrics counters before and after it. Each run sends its own
`cache_salt`, so that a run never finds the prompts of the runs before it in folio's prefix cache (the
same requests go out at every level). `sweep` is shared with the llama-server peer (spec_peer.py), whose
drafts come from its responses' timings instead (and whose prompt cache is off: `cache_prompt: false`).
A run's MFU is `folio bench serve`'s (serve.py's `served_mfu`): the completed requests' FLOPs, from the
prompt and output tokens each had, over the run's wall time; a served cell has no MBU (the batch of each
step is the server's to choose, so its bytes per token are unknown here).
"""

from __future__ import annotations

import asyncio
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from folio_tools.bench.harness.folio_server import folio_server
from folio_tools.bench.harness.roofline import MachinePeaks, TokenCost
from folio_tools.bench.serve.client import ServeRequest, Target, probe, run_rate
from folio_tools.bench.serve.command import served_mfu
from folio_tools.bench.serve.stats import RequestRecord, summarize
from folio_tools.bench.spec.counters import SpecCounts, from_llama_timings, scrape_metrics
from folio_tools.bench.spec.values import Cell, SpecConfig, Variant


def _drafts(source: str, base_url: str, before: SpecCounts | None, records: list[RequestRecord]) -> SpecCounts | None:
    """A run's drafts: from folio serve's /metrics (read `before` and now), or llama-server's timings."""
    if source == "llama.cpp timings":
        return from_llama_timings(r.server_timings for r in records if r.success)
    after = scrape_metrics(base_url)
    return after.since(before) if before is not None and after is not None else None


def sweep(
    base_url: str,
    config: SpecConfig,
    workloads: dict[str, list[ServeRequest]],
    levels: list[int],
    describe: dict[str, Any],
    drafts_from: str,
    extra_body: dict[str, Any],
    cost: TokenCost,
    peaks: MachinePeaks,
    salted: bool = False,
) -> list[Cell]:
    """Every workload at every concurrency level against one running server. `describe` gives the cells'
    engine, variant, method and baseline; `drafts_from` is "/metrics" or "llama.cpp timings"; `cost` and
    `peaks` give each run's MFU; `salted`: each run sends a `cache_salt` of its own."""
    target = Target(base_url, config.model, chat=True, timeout_s=config.timeout_s, extra_body=extra_body)
    target, _ = asyncio.run(probe(target, next(iter(workloads.values()))[0]))
    cells = []
    for name, requests in workloads.items():
        for level in levels:
            print(f"folio: [{describe['engine']} {describe['variant']}] {name} at concurrency {level}",
                  file=sys.stderr, flush=True)  # fmt: skip
            salt = {"cache_salt": f"{name}-c{level}"} if salted else {}
            run_target = replace(target, extra_body={**extra_body, **salt})
            before = scrape_metrics(base_url) if drafts_from == "/metrics" else None
            records, duration = asyncio.run(run_rate(run_target, requests, math.inf, config.seed, level, False))
            spec = _drafts(drafts_from, base_url, before, records) if describe["method"] != "none" else None
            summary = summarize(records, duration, {})
            cells.append(Cell(
                **describe, workload=name, setting=f"c{level}", concurrency=level, num_requests=len(records),
                completed=summary["completed"], output_tokens=summary["output_tokens"], duration_s=duration,
                tpot_ms=summary["tpot_ms"], ttft_ms=summary["ttft_ms"], spec=spec,
                mfu=served_mfu(records, duration, cost, peaks),
            ))  # fmt: skip
            if summary["failed"]:
                first_error = next(r.error for r in records if not r.success)
                print(f"folio: {summary['failed']} request(s) failed; first error: {first_error}", file=sys.stderr)
    return cells


def request_extra_body(config: SpecConfig) -> dict[str, Any]:
    """What every request adds to the client's body: the client asks for ignore_eos, which --ignore-eos
    keeps and its absence turns off."""
    return {"ignore_eos": config.ignore_eos}


def run_folio_served(
    config: SpecConfig,
    workloads: dict[str, list[ServeRequest]],
    log_dir: Path,
    servers: list[dict[str, str]],
    cost: TokenCost,
    peaks: MachinePeaks,
) -> list[Cell]:
    """Each variant's `folio serve` in turn over every workload and concurrency, with MFU from `cost` and
    `peaks`; the command line each server was started with is appended to `servers`."""
    cells: list[Cell] = []
    queue = ["--max-queue", str(config.num_prompts)]  # every request of a run queued, never a 429
    for variant in config.variants:
        flags = [*queue, *variant.engine_args.to_cli_flags()]
        with folio_server(config.model, flags, log_dir / f"folio-{variant.name}.log") as server:
            print(f"folio: [folio {variant.name}] {server.command}", file=sys.stderr, flush=True)
            servers.append({"name": f"folio {variant.name}", "command": server.command})
            cells += sweep(server.base_url, config, workloads, config.concurrency, _describe(variant), "/metrics",
                           request_extra_body(config), cost, peaks, salted=True)  # fmt: skip
    return cells


def _describe(variant: Variant) -> dict[str, Any]:
    return {"engine": "folio", "variant": variant.name, "method": variant.method, "baseline": variant.baseline}
