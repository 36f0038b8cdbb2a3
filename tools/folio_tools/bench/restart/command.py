"""`folio bench restart`: the first token of a long prompt a server has seen before it restarted. With
`--kv-cache-dir`, folio serve keeps every computed prefix-cache block as a file, so after a restart the prompt's
blocks are read back instead of computed; llama-server keeps nothing across a restart (its `--slot-save-path`
needs a client to save and restore slots by hand), so it is measured as it is.

Each round takes a different prompt of `--prompt-len` tokens (a document of ShareGPT answers, as `bench serve
--dataset document` makes). folio serve starts with a fresh `--kv-cache-dir` and gets the prompt cold; then
again, served from the pool (in memory); then it stops, starts again on the same directory and gets the prompt
once more (restarted). llama-server, on the same GGUF file, gets it cold, stops, starts again and gets it again.
Every start is followed by one short request first, so no figure pays for a first request's warm-up. The time
runs from sending a streamed completion to its first token; the report gives medians over the rounds and
folio's cold time over its restarted time (the figure the disk tier is for).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from folio.engine_args import EngineArgs
from folio.loaders.catalog import resolve_model
from folio_tools.bench.harness.flags import add_output_dir, command_line
from folio_tools.bench.harness.plots import figure, grouped_engine_bars
from folio_tools.bench.harness.table import row
from folio_tools.bench.peers.llama_cpp_build import build_llama_cpp
from folio_tools.bench.peers.llama_cpp_server import free_port, server_command, stop_process, wait_for_health
from folio_tools.bench.serve.prefix_workloads import make_document, sharegpt_answers
from folio_tools.bench.serve.workload import load_tokenizer
from folio_tools.bench.serve_compare.command import STOP_GRACE_S, server_session, start_process, wait_until_ready
from folio_tools.bench.serve_compare.peers import STARTUP_TIMEOUT_S
from folio_tools.bench.swap.command import first_token_seconds
from folio_tools.results import machine_info, result_paths, write_json

WARM_UP = "Write one sentence about the sea."


@dataclass(frozen=True)
class RestartBenchConfig:
    model: str = "smollm2-135m"
    prompt_len: int = 2000
    rounds: int = 3
    engine_args: EngineArgs = field(default_factory=EngineArgs)  # folio serve's flags; --kv-cache-dir is the bench's
    peer: bool = True
    llama_version: str | None = None
    output_dir: Path = Path("benchmarks/results")

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"--rounds must be at least 1, got {self.rounds}")
        if self.prompt_len < 16:
            raise ValueError(f"--prompt-len must be at least 16 tokens, got {self.prompt_len}")


def _prompts(config: RestartBenchConfig) -> list[str]:
    tokenizer = load_tokenizer(config.model, explicit=False).tokenizer
    answers = sharegpt_answers(None)
    alone = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731 - a piece of text, no BOS
    return [make_document(answers, alone, tokenizer.decode, config.prompt_len, seed) for seed in range(config.rounds)]


def _folio(config: RestartBenchConfig, cache_dir: Path, log: Path, stack: ExitStack) -> tuple[str, str]:
    port = free_port()
    argv = [sys.executable, "-m", "folio.cli", "serve", config.model, "--host", "127.0.0.1", "--port", str(port),
            *config.engine_args.to_cli_flags(), "--kv-cache-dir", str(cache_dir)]  # fmt: skip
    process = start_process(argv, log)
    stack.callback(stop_process, process, STOP_GRACE_S)  # SIGTERM: the disk tier finishes its writes
    url = f"http://127.0.0.1:{port}"
    wait_until_ready("folio", url, process, STARTUP_TIMEOUT_S, log)
    first_token_seconds(url, config.model, WARM_UP)
    return url, " ".join(argv)


def _llama(config: RestartBenchConfig, log: Path, stack: ExitStack) -> tuple[str, str]:
    binaries = build_llama_cpp(version=config.llama_version)
    port = free_port()
    context = config.prompt_len + 512  # the prompt re-tokenized, the warm-up, the few tokens generated
    argv = server_command(binaries, resolve_model(config.model), port, ctx_size=context, parallel=1,
                          extra_args=["--alias", config.model])  # fmt: skip
    process = start_process(argv, log)
    stack.callback(stop_process, process, STOP_GRACE_S)
    url = f"http://127.0.0.1:{port}"
    wait_for_health(url, process, timeout=STARTUP_TIMEOUT_S, log_path=log)
    first_token_seconds(url, config.model, WARM_UP)
    return url, " ".join(argv)


def run_restart_bench(config: RestartBenchConfig) -> dict[str, Any]:
    if config.peer and resolve_model(config.model).suffix.lower() != ".gguf":
        raise ValueError(f"llama-server needs a GGUF model, and {config.model} is not one (or pass --no-peer)")
    prompts = _prompts(config)
    date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    times: dict[str, dict[str, list[float]]] = {"folio": {}, "llama.cpp": {}}
    commands: dict[str, str] = {}
    with server_session("folio-bench-restart-") as logs, tempfile.TemporaryDirectory(prefix="folio-kv-") as tmp:
        for index, prompt in enumerate(prompts):
            cache_dir = Path(tmp) / f"round-{index}"
            folio = times["folio"]
            with ExitStack() as stack:
                url, commands["folio"] = _folio(config, cache_dir, logs / "folio.log", stack)
                folio.setdefault("cold", []).append(first_token_seconds(url, config.model, prompt))
                folio.setdefault("in_memory", []).append(first_token_seconds(url, config.model, prompt))
            with ExitStack() as stack:
                url, _ = _folio(config, cache_dir, logs / "folio.log", stack)
                folio.setdefault("restarted", []).append(first_token_seconds(url, config.model, prompt))
            if config.peer:
                llama = times["llama.cpp"]
                for key in ("cold", "restarted"):
                    with ExitStack() as stack:
                        url, commands["llama.cpp"] = _llama(config, logs / "llama.log", stack)
                        llama.setdefault(key, []).append(first_token_seconds(url, config.model, prompt))
            print(f"round {index + 1}: folio cold {folio['cold'][-1]:.2f} s, in memory {folio['in_memory'][-1]:.3f} "
                  f"s, restarted {folio['restarted'][-1]:.3f} s", flush=True)  # fmt: skip
    summary: dict[str, Any] = {
        engine: {key: statistics.median(values) for key, values in runs.items()}
        for engine, runs in times.items()
        if runs
    }
    summary["folio_cold_over_restarted"] = statistics.median(
        c / r for c, r in zip(times["folio"]["cold"], times["folio"]["restarted"], strict=True)
    )
    if config.peer:
        summary["llama_cpp_restarted_over_folio_restarted"] = statistics.median(
            ll / f for ll, f in zip(times["llama.cpp"]["restarted"], times["folio"]["restarted"], strict=True)
        )
    settings = {**asdict(config), "engine_args": config.engine_args.llm_kwargs(), "output_dir": str(config.output_dir)}
    return {"kind": "restart", "date_utc": date, "machine": machine_info(), "config": settings,
            "commands": commands, "seconds_to_first_token": times, "summary": summary}  # fmt: skip


def report(result: dict[str, Any], json_path: Path, png_path: Path) -> None:
    summary = result["summary"]
    engines = [e for e in ("folio", "llama.cpp") if e in summary]
    cases = ["cold", "in_memory", "restarted"]
    print(row("seconds to first token", cases))
    for engine in engines:
        print(row(engine, [summary[engine].get(case) for case in cases]))
    print(f"folio cold / restarted: {summary['folio_cold_over_restarted']:.1f}x")
    if "llama_cpp_restarted_over_folio_restarted" in summary:
        print(f"after a restart, llama.cpp / folio: {summary['llama_cpp_restarted_over_folio_restarted']:.1f}x")
    title = f"first token of a {result['config']['prompt_len']}-token prompt seen before, {result['date_utc']}"
    shown = ["cold", "restarted"]
    with figure(png_path, figsize=(8, 4), title=title) as (_, ax):
        values = {engine: [summary[engine][case] for case in shown] for engine in engines}
        grouped_engine_bars(ax, shown, values, "%.2f s", "seconds to the first token (lower is better)")
    write_json(json_path, result)
    print(f"wrote {json_path} and {png_path}")


def run_restart_command(args: argparse.Namespace) -> int:
    try:
        config = RestartBenchConfig(args.model, args.prompt_len, args.rounds, EngineArgs.from_cli_args(args),
                                    args.peer, args.llama_version, Path(args.output_dir))  # fmt: skip
        if config.engine_args.kv_cache_dir is not None:
            raise ValueError("--kv-cache-dir is the benchmark's own (a fresh directory per round)")
        result = run_restart_bench(config)
    except (ValueError, RuntimeError, httpx.HTTPError) as exc:  # ServerError and LlamaCppBuildError among them
        print(f"error: {exc}", file=sys.stderr)
        return 1
    result["command"] = command_line(args)
    json_path, png_path = result_paths(config.output_dir, "restart", config.model, result["date_utc"])
    report(result, json_path, png_path)
    return 0


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "restart",
        help="first token of a long prompt seen before a restart: folio serve --kv-cache-dir vs cold, and llama-server",
        description=__doc__.split("\n\n")[0].replace("\n", " ") if __doc__ else None,
    )
    parser.add_argument("model", nargs="?", default="smollm2-135m", help="catalog name or .gguf (default smollm2-135m)")
    parser.add_argument("--prompt-len", type=int, default=2000, help="tokens of each round's prompt (default 2000)")
    parser.add_argument("--rounds", type=int, default=3, help="prompts, each through the whole cycle (default 3)")
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="folio only (no llama-server)")
    parser.add_argument("--llama-version", default=None, help="llama-cpp-python version (default: the installed build)")
    add_output_dir(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(bench_run=run_restart_command)
