"""Benchmark runs as command lines: every option spelled out, defaults included, so a result file says
exactly how to run it again. (A `folio serve` started by a benchmark gets its engine flags from
`EngineArgs.to_cli_flags`.)"""

from __future__ import annotations

import argparse
import shlex

from folio.engine_args import SWITCHES_OFF_BY_DEFAULT

_NOT_OPTIONS = ("command", "bench_command", "bench_run")
# Benchmarks' own switches that are off by default, written only when on (as the engine's are).
_BENCH_SWITCHES_OFF_BY_DEFAULT = ("prefill",)
DEFAULT_OUTPUT_DIR = "benchmarks/results"


def add_output_dir(parser: argparse.ArgumentParser, what: str = "JSON + PNG go") -> None:
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR, help=f"{what} here ({DEFAULT_OUTPUT_DIR})")


def option_words(key: str, value: object) -> list[str]:
    """One option as command-line words. Booleans are `--no-...` switches whose default is True:
    `enable_x=False` is `--no-x`, `probe_request=False` is `--no-probe-request`; except the engine's
    switches that are off by default, and the benchmarks' own: `compile=True` is `--compile`."""
    if isinstance(value, bool) and key in (*SWITCHES_OFF_BY_DEFAULT, *_BENCH_SWITCHES_OFF_BY_DEFAULT):
        return [f"--{key.replace('_', '-')}"] if value else []
    if isinstance(value, bool):
        return [] if value else [f"--no-{key.removeprefix('enable_').replace('_', '-')}"]
    option = f"--{key.replace('_', '-')}"
    return [option, *map(str, value)] if isinstance(value, list) else [option, str(value)]


def command_line(args: argparse.Namespace, positionals: tuple[str, ...] = ("model",)) -> str:
    """The run as a `folio bench <benchmark>` command; `positionals` are written first, as arguments."""
    words = ["folio", "bench", args.bench_command, *(str(getattr(args, name)) for name in positionals)]
    for key, value in vars(args).items():
        if key in _NOT_OPTIONS or key in positionals or value is None or callable(value):
            continue
        words += option_words(key, value)
    return shlex.join(words)
