"""`folio bench serve-compare`: `folio serve` against a peer server (llama.cpp's llama-server, or folio itself
without its prefix cache), the same seeded `bench serve` workload sent to each, in one run.

Each server is started as a subprocess on a free 127.0.0.1 port, waited for until GET /health answers 200,
benchmarked at every rate with `run_serve`, and stopped with SIGTERM before the next one starts: they share
the machine's cores, so they never run together. Both are stopped on any error, on Ctrl-C and on SIGTERM to
this process, and the exact command line each one was started with goes into the report.

The peer comes from `PEERS`, a registry of launchers: a launcher turns the run's config into a `ServerSpec`
(the command line for a port, the extra request body, facts for the report). Every launcher runs before any
server starts, so a missing llama.cpp build or a model that is not a GGUF fails at once rather than after
folio's whole run. Tests register their own peer there.

`--peer folio-no-kv-tiers` is `folio serve` with the same engine options but no KV tiers (`--kv-offload-ram`,
`--kv-cache-dir`): with `--dataset agent` it shows what the tiers buy. `--peer llama.cpp-cache-ram` is llama-server
with its prompt cache on and `--cache-ram` as large as folio's `--kv-offload-ram`: llama.cpp's own answer.
`--peer folio-no-prefix-cache` is `folio serve` with the same engine options plus `--no-prefix-caching`: with
a prefix-sharing workload (`--dataset document`, `tenants` or `multi-turn`) the table shows TTFT with and
without the cache side by side. The folio side takes the engine options as given, so it runs without the cache
too if they include --no-prefix-caching.

`--peer folio-replicas` is `folio serve` with the same engine options on two replicas behind one endpoint
(`--replicas 2 --cpus-per-replica 1`, Ray Serve, routed by prefix cache and load); `folio-replicas-round-robin`
the same with `--routing round_robin`: with `--dataset tenants` they show what routing each tenant's prompts to
the replica holding its document buys. Their /metrics are refreshed from the replicas about once a second, so
their runs wait `ServerSpec.metrics_lag_s` before reading the prefix-cache counters. `folio-ray-1` is one
replica of two CPUs: against plain `folio serve` on the same cores it measures what the Ray path costs.
`--peer folio-engine-process` is `folio serve` with the engine in a process of its own: against plain
`folio serve` it measures what taking the engine loop out of the HTTP server's process buys.
`folio-disaggregated` is one prefill and one decode replica of one CPU each (`--disaggregate`): against
`folio-replicas` on a mix of long prompts and long outputs it shows what taking prefills off the decode
engine buys.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from folio.engine_args import EngineArgs
from folio_tools.bench.harness.flags import add_output_dir, command_line
from folio_tools.bench.peers.llama_cpp_server import free_port, poll_health, stop_process
from folio_tools.bench.serve.client import parse_extra_body
from folio_tools.bench.serve.command import add_workload_args, run_serve, workload_config
from folio_tools.bench.serve.workload import check_dataset
from folio_tools.bench.serve_compare.peers import PEERS, CompareConfig, folio_spec
from folio_tools.bench.serve_compare.report import format_table, write_report
from folio_tools.bench.serve_compare.values import CompareReport, LlamaOptions, ServerError, ServerRun, ServerSpec
from folio_tools.results import machine_info

STOP_GRACE_S = 30.0  # SIGTERM, then SIGKILL after this long


def start_process(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start a server with its output in `log_path` (a pipe nobody reads would fill up and stall it)."""
    # The client sends no API key to folio, so folio serve must not pick one up from the environment.
    env = {key: value for key, value in os.environ.items() if key != "FOLIO_API_KEY"}
    with log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def _last_line(log_path: Path) -> str:
    try:
        lines = [line.strip() for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines()]
    except OSError:
        return ""
    last = next((line for line in reversed(lines) if line), "")
    return f": {last[:300]}" if last else ""


def wait_until_ready(name: str, base_url: str, process: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    """Block until GET /health answers 200; raise ServerError (one line, naming the log) if the server
    exits first or takes longer than `timeout`."""
    failure = poll_health(base_url, process, timeout)
    if failure == "exited":
        raise ServerError(
            f"the {name} server exited with code {process.returncode} before it was ready{_last_line(log)} (log: {log})"
        )
    if failure == "timeout":
        raise ServerError(f"the {name} server at {base_url} was not ready after {timeout:g}s (log: {log})")


@contextmanager
def running_server(spec: ServerSpec, log_path: Path, timeout: float) -> Iterator[tuple[str, str]]:
    """A ready server on a free port; yields its base URL and the command line it was started with. The
    server is stopped (SIGTERM, then SIGKILL after a grace period) however the block ends."""
    port = free_port()
    argv = spec.argv(port)
    process = start_process(argv, log_path)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_until_ready(spec.name, base_url, process, timeout, log_path)
        yield base_url, shlex.join(argv)
        if process.poll() is not None:
            raise ServerError(
                f"the {spec.name} server exited with code {process.returncode} during the run (log: {log_path})"
            )
    finally:
        stop_process(process, grace=STOP_GRACE_S)


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt, so killing the benchmark still stops the server it started."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield
        return

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def server_session(prefix: str) -> Iterator[Path]:
    """A temporary folder for the logs of the servers a benchmark starts, with SIGTERM stopping them too.
    The logs are deleted at the end unless a ServerError escaped: its message names the log to read."""
    log_dir = Path(tempfile.mkdtemp(prefix=prefix))
    keep_logs = False
    try:
        with _sigterm_as_interrupt():
            yield log_dir
    except ServerError:
        keep_logs = True
        raise
    finally:
        if not keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)


def run_compare(config: CompareConfig, command: str) -> CompareReport:
    """folio, then the peer, one at a time, each through the same `run_serve` workload."""
    check_dataset(config.workload.dataset, config.workload.dataset_path)
    specs = [folio_spec(config), PEERS[config.peer](config)]  # both before any server starts: fail fast
    date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    runs = []
    with server_session("folio-serve-compare-") as log_dir:
        for spec in specs:
            with running_server(spec, log_dir / f"{spec.name}.log", config.startup_timeout_s) as (url, line):
                print(f"folio: [{spec.name}] {line}", file=sys.stderr, flush=True)
                workload = replace(config.workload, base_url=url, extra_body=spec.extra_body,
                                   probe_request=spec.probe_request, metrics_lag_s=spec.metrics_lag_s)  # fmt: skip
                runs.append(ServerRun(spec.name, line, spec.info, run_serve(workload, command, spec.name)))
    return CompareReport(command, date, config, machine_info(), runs)


def run_serve_compare_command(args: argparse.Namespace) -> int:
    """The runner `folio bench serve-compare` stores in `args.bench_run`."""
    try:
        llama_extra_body = parse_extra_body(args.llama_extra_body)
    except ValueError as exc:
        raise ValueError(str(exc).replace("--extra-body", "--llama-extra-body")) from None
    workload = workload_config(args, "http://127.0.0.1")  # each server's own URL, once it runs
    llama = LlamaOptions(args.llama_parallel, args.llama_ctx_size, args.llama_threads, llama_extra_body,
                         args.llama_version)  # fmt: skip
    config = CompareConfig(args.model, workload, args.peer, EngineArgs.from_cli_args(args), llama)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)  # now, not after a long run
    report = run_compare(config, command_line(args))
    print(format_table(report))
    for path in write_report(report, output_dir):
        print(f"wrote {path}")
    results = [(run.name, result) for run in report.runs for result in run.report.results]
    if failed := sum(result.summary["failed"] for _, result in results):
        name, first = next((n, r.error) for n, result in results for r in result.records if not r.success)
        print(f"folio: {failed} request(s) failed; first error ({name}): {first}", file=sys.stderr)
    return 1 if any(result.summary["completed"] == 0 for _, result in results) else 0


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "serve-compare",
        help="online serving, folio serve vs a peer server (llama.cpp, or folio without prefix caching), same "
        "workload in one run",
        description="Start `folio serve MODEL`, run the `bench serve` workload against it, stop it; then start "
        "the peer (llama.cpp's llama-server on the same GGUF file) and run the same seeded workload against "
        "it. The servers run one at a time, never together. Prints both side by side per rate with the "
        "ratio folio/peer, and writes one JSON (both results, ratios, both servers' command lines) and PNG "
        "plots. Engine options (--dtype, --max-num-seqs, ...) go to folio serve. --peer folio-no-prefix-cache "
        "runs folio serve again with the same engine options plus --no-prefix-caching: with --dataset document "
        "or multi-turn it shows TTFT with and without the prefix cache side by side (the folio side keeps the "
        "engine options as given, so do not pass --no-prefix-caching there).",
    )
    parser.add_argument("model", help="catalog name or .gguf file (llama.cpp needs a GGUF)")
    parser.add_argument(
        "--peer",
        default="llama.cpp",
        help="the server to compare with: llama.cpp (default), or llama.cpp with its prompt cache and --cache-ram "
        "(llama.cpp-cache-ram); or folio serve with the same engine options and --no-prefix-caching "
        "(folio-no-prefix-cache), without --kv-offload-ram and --kv-cache-dir (folio-no-kv-tiers), --batching "
        "static (folio-static), --batching "
        "dynamic (folio-dynamic), --engine-process (folio-engine-process), or on two replicas behind one "
        "endpoint, --replicas 2 --cpus-per-replica 1, routed by prefix cache (folio-replicas) or round robin "
        "(folio-replicas-round-robin), or one replica of two CPUs (folio-ray-1: the Ray path's own cost), or one "
        "prefill and one decode replica (folio-disaggregated)",
    )
    add_workload_args(parser)
    parser.add_argument("--llama-parallel", type=int, default=16, help="llama-server slots (default 16)")
    parser.add_argument(
        "--llama-ctx-size",
        type=int,
        default=None,
        help="llama-server's total KV tokens, split evenly over the slots (default: parallel * (longest prompt "
        "+ longest output + 64), each slot rounded up to a multiple of 256)",
    )
    parser.add_argument("--llama-threads", type=int, default=2, help="llama-server threads (default 2)")
    parser.add_argument(
        "--llama-extra-body",
        default='{"cache_prompt": false}',
        metavar="JSON",
        help="JSON merged into every request to llama-server (default '{\"cache_prompt\": false}': no reuse "
        "of an earlier prompt's KV cache; give '{}' to compare with folio's prefix cache, which is on unless "
        "--no-prefix-caching)",
    )
    parser.add_argument(
        "--llama-version", default=None, help="llama-cpp-python version to build (default: the installed build)"
    )
    add_output_dir(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(bench_run=run_serve_compare_command)
