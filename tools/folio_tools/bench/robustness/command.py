"""`folio bench fuzz` and `folio bench overload`: the server's robustness, measured on a `folio serve`
the command starts itself (or, for fuzz, one already running at --base-url)."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from folio.engine_args import EngineArgs
from folio_tools.bench.harness.flags import add_output_dir, command_line
from folio_tools.bench.harness.folio_server import against_server, folio_server, resident_mib
from folio_tools.bench.robustness.fuzz import HOSTILE_SHARE, run_fuzz
from folio_tools.bench.robustness.overload import OverloadConfig, run_overload
from folio_tools.bench.robustness.report import format_fuzz, format_overload, write_fuzz, write_overload
from folio_tools.results import result_paths

AddEngineArgs = Callable[[argparse.ArgumentParser], None]


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    fuzz = benchmarks.add_parser(
        "fuzz",
        help="schemathesis against folio serve: only 2xx/4xx, the server alive and empty at the end",
        description="Generate requests from the server's own OpenAPI schema with schemathesis (fitting it and "
        "breaking it) and hostile shapes beside them (deep nesting, huge lists, lone surrogates, NaN at every POST "
        "route), send them one at a time, and check that every answer is 2xx or 4xx in its API's error format (a "
        "hostile shape 4xx), that no stream ends with a server error, and that afterwards the server is healthy and "
        "holds no admission slot, request or KV block.",
    )
    fuzz.add_argument("model", nargs="?", default="smollm2-135m")
    fuzz.add_argument("--cases", type=int, default=10_000, help="requests to generate (default 10000)")
    fuzz.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    fuzz.add_argument("--hostile-share", type=float, default=HOSTILE_SHARE,
                      help="share of the cases that are hostile shapes: deep nesting, huge lists, lone surrogates, "
                      f"NaN (default {HOSTILE_SHARE})")  # fmt: skip
    fuzz.add_argument("--base-url", default=None, help="fuzz this running folio server instead of starting one")
    add_output_dir(fuzz)
    EngineArgs.add_cli_args(fuzz)
    fuzz.set_defaults(bench_run=_run_fuzz, max_model_len=96)  # short answers: more cases per minute

    overload = benchmarks.add_parser(
        "overload",
        help="10x the server's capacity in clients for a while: only 200/429, bounded memory, empty at the end",
        description="Start folio serve with a small capacity (--max-num-seqs + --max-queue) and run --concurrency "
        "clients (default 10x that capacity) sending completions and chats back to back for --duration seconds; "
        "check that every answer is 200 or 429, no stream ends with an error, the server's resident memory stays "
        "bounded, and that afterwards it is healthy and holds nothing.",
    )
    overload.add_argument("model", nargs="?", default="smollm2-135m")
    overload.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    overload.add_argument("--concurrency", type=int, default=None, help="clients (default 10 x capacity)")
    overload.add_argument("--max-queue", type=int, default=4, help="the server's --max-queue (default 4)")
    overload.add_argument("--max-tokens-range", default="4:48", help="tokens per request, LOW:HIGH (default 4:48)")
    overload.add_argument("--seed", type=int, default=0)
    add_output_dir(overload)
    EngineArgs.add_cli_args(overload)
    # A KV pool small enough that the run touches all of it: its pages are mapped lazily, so with a
    # large pool the resident memory would grow for the whole run as new blocks are first written.
    overload.set_defaults(bench_run=_run_overload, max_num_seqs=4, max_model_len=512, kv_cache_memory="128MiB")


def _server_flags(args: argparse.Namespace, *extra: str) -> list[str]:
    return [*EngineArgs.from_cli_args(args).to_cli_flags(), *extra]


def _run_fuzz(args: argparse.Namespace) -> int:
    if args.cases < 1:
        raise ValueError("--cases must be at least 1")
    if not 0 <= args.hostile_share <= 1:
        raise ValueError("--hostile-share must be in [0, 1]")
    date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    report, report.server = against_server(
        args.model, _server_flags(args), args.base_url,
        lambda url: run_fuzz(url, args.cases, args.seed, hostile_share=args.hostile_share),
    )  # fmt: skip
    report.command, report.date_utc = command_line(args), date
    print(format_fuzz(report))
    json_path, png_path = result_paths(Path(args.output_dir), "fuzz", args.model, date, f"{args.cases}cases")
    write_fuzz(report, json_path, png_path)
    print(f"wrote {json_path}\nwrote {png_path}")
    return 0 if report.passed else 1


def _run_overload(args: argparse.Namespace) -> int:
    low, _, high = args.max_tokens_range.partition(":")
    capacity = args.max_num_seqs + args.max_queue
    clients = args.concurrency or 10 * capacity
    config = OverloadConfig(args.model, args.duration, clients, (int(low), int(high or low)), args.seed)
    date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    with tempfile.TemporaryDirectory() as tmp:
        flags = _server_flags(args, "--max-queue", str(args.max_queue))
        with folio_server(args.model, flags, Path(tmp) / "server.log") as running:
            report = run_overload(config, running.base_url, lambda: resident_mib(running.pid))
            report.server = {"command": running.command, "capacity": capacity}
    report.command, report.date_utc = command_line(args), date
    print(format_overload(report))
    json_path, png_path = result_paths(Path(args.output_dir), "overload", args.model, date, f"{clients}clients")
    write_overload(report, json_path, png_path)
    print(f"wrote {json_path}\nwrote {png_path}")
    return 0 if report.passed else 1
