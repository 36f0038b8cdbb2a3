"""`folio bench ...`: one sub-subcommand per benchmark. Each benchmark module registers its own parser
(`add_parser`), which stores its runner in `args.bench_run`; adding a benchmark is one more entry in
BENCHMARKS."""

from __future__ import annotations

import argparse

from folio_tools.bench import decode, profile, quantization
from folio_tools.bench.lora import command as lora
from folio_tools.bench.parallel import command as parallel
from folio_tools.bench.restart import command as restart
from folio_tools.bench.robustness import command as robustness
from folio_tools.bench.robustness import stall
from folio_tools.bench.serve import command as serve
from folio_tools.bench.serve_compare import command as serve_compare
from folio_tools.bench.spec import command as spec
from folio_tools.bench.structured import command as structured
from folio_tools.bench.swap import command as swap
from folio_tools.bench.throughput import command as throughput

BENCHMARKS = (
    throughput,
    serve,
    serve_compare,
    structured,
    decode,
    quantization,
    robustness,
    stall,
    spec,
    lora,
    swap,
    restart,
    parallel,
    profile,
)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add `bench` and its benchmarks to the `folio` parser's subcommands (folio_tools/cli.py calls this)."""
    bench = subparsers.add_parser("bench", help="measure folio's speed, side by side with a peer engine")
    bench.set_defaults(tool_run=run_bench)
    benchmarks = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for benchmark in BENCHMARKS:
        benchmark.add_parser(benchmarks)


def run_bench(args: argparse.Namespace) -> int:
    return args.bench_run(args)
