"""`folio bench serve`: a client-side serving benchmark against any OpenAI-compatible server (folio's own
`folio serve`, llama.cpp's llama-server, vLLM, ...), in the manner of vLLM's benchmark_serving.

One seeded workload is sent at each request rate in turn: Poisson arrivals, every request streamed, greedy
with EOS ignored so each decodes exactly its output length. Per request it records TTFT, the gaps between
chunks (ITL), TPOT and end-to-end latency; per rate, latency percentiles, request and token throughput,
goodput under the SLOs given and the cost of a million output tokens at a given hourly price.
`--extra-body JSON` is merged into every request, e.g. '{"cache_prompt": false}' for llama-server, whose
prompt cache is on by default.

When the server counts prefix-cache tokens at /metrics (folio, vLLM), each rate also reports the prompt tokens
it looked up in the prefix cache and those it found there (serve_metrics.py). The cache is not emptied between
rates, so a later rate of a prefix-sharing workload (document, multi-turn) finds the earlier rate's prompts;
the probe request before the first rate already caches the document of `document`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import UTC, datetime
from typing import Any

from folio.bench.datasets import LengthRange
from folio.bench.flags import command_line
from folio.bench.serve_client import (
    ServeRequest,
    Target,
    parse_extra_body,
    probe,
    run_rate,
)
from folio.bench.serve_metrics import prefix_cache_delta, scrape_prefix_cache
from folio.bench.serve_report import format_table, write_report
from folio.bench.serve_stats import parse_slo, summarize
from folio.bench.serve_types import RateResult, ServeConfig, ServeReport
from folio.bench.serve_workload import build_serve_requests, check_dataset, load_tokenizer
from folio.results import machine_info


def parse_rates(values: list[str]) -> list[float]:
    rates = []
    for value in values:
        try:
            rates.append(float(value))
        except ValueError:
            raise ValueError(f"--request-rate {value!r} is not a number of requests/s (or inf)") from None
    return rates


def run_serve(config: ServeConfig, command: str, label: str | None = None) -> ServeReport:
    check_dataset(config.dataset, config.dataset_path)
    bench_tokenizer = load_tokenizer(config.tokenizer or config.model, explicit=config.tokenizer is not None)
    workload = build_serve_requests(
        config.dataset,
        bench_tokenizer,
        config.num_prompts,
        config.input_len_range,
        config.output_len_range,
        config.seed,
        config.dataset_path,
        turns=config.turns,
        document_len=config.document_len,
    )
    requests = workload.requests
    target = Target(
        config.base_url, config.model, chat=config.chat, timeout_s=config.timeout_s, extra_body=config.extra_body
    )
    target, server = asyncio.run(probe(target, requests[0], config.probe_request))
    if not target.include_usage:
        print("folio: the server refused stream_options; counting output tokens from chunks", file=sys.stderr)
    date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    results = []
    for rate in config.request_rates:
        before = scrape_prefix_cache(config.base_url)
        records, duration = asyncio.run(
            run_rate(target, requests, rate, config.seed, config.max_concurrency, config.use_tqdm)
        )
        summary = summarize(records, duration, config.slo, config.price_per_hour)
        summary["prefix_cache"] = prefix_cache_delta(
            before, scrape_prefix_cache(config.base_url) if before is not None else None
        )
        results.append(RateResult(rate, summary, records))
    return ServeReport(
        command=command,
        date_utc=date,
        config=config,
        label=label or config.model,
        tokenizer=str(bench_tokenizer.path),
        server=server,
        workload=_workload(requests) | workload.facts,
        results=results,
        machine=machine_info(),
    )


def _workload(requests: list[ServeRequest]) -> dict[str, Any]:
    n = len(requests)
    return {
        "num_requests": n,
        "mean_prompt_tokens": sum(r.prompt_len for r in requests) / n,
        "mean_output_tokens": sum(r.output_len for r in requests) / n,
        "total_output_tokens": sum(r.output_len for r in requests),
    }


def workload_config(args: argparse.Namespace, base_url: str, **settings: Any) -> ServeConfig:
    """A ServeConfig from the workload options `bench serve` and `bench serve-compare` share."""
    return ServeConfig(
        base_url=base_url,
        model=args.model,
        input_len_range=LengthRange.parse(args.input_len_range, "--input-len-range"),
        output_len_range=LengthRange.parse(args.output_len_range, "--output-len-range"),
        dataset=args.dataset,
        dataset_path=args.dataset_path,
        num_prompts=args.num_prompts,
        request_rates=parse_rates(args.request_rate),
        max_concurrency=args.max_concurrency,
        slo=parse_slo(args.slo),
        price_per_hour=args.price_per_hour,
        seed=args.seed,
        timeout_s=args.timeout,
        turns=args.turns,
        document_len=args.document_len,
        **settings,
    )


def run_serve_command(args: argparse.Namespace) -> int:
    """The runner `folio bench serve` stores in `args.bench_run`."""
    from pathlib import Path

    config = workload_config(
        args,
        args.base_url,
        tokenizer=args.tokenizer,
        extra_body=parse_extra_body(args.extra_body),
        probe_request=args.probe_request,
    )
    report = run_serve(config, command_line(args, positionals=()), args.label)
    print(format_table(report))
    for path in write_report(report, Path(args.output_dir)):
        print(f"wrote {path}")
    failed = sum(r.summary["failed"] for r in report.results)
    if failed:
        first = next(r.error for result in report.results for r in result.records if not r.success)
        print(f"folio: {failed} request(s) failed; first error: {first}", file=sys.stderr)
    return 1 if any(r.summary["completed"] == 0 for r in report.results) else 0
