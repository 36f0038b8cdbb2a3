"""`folio bench swap`: how long a request for a model that is not loaded waits for its first token, on a
server of several models that holds one at a time: `folio serve A B --max-loaded-models 1` beside
llama-server's router mode (`--models-dir` over the same two GGUF files, `--models-max 1`).

Each swap asks for the model that is not loaded, so the server must unload the other and load it; the
time runs from sending the streamed request to its first token. A warm request (the same model again,
loaded) is measured after each swap, which tells the load from the answer itself. Each swap comes after
`--settle` idle seconds, as a request for another model comes after a while in use: what a server
does in the background after a load (folio starts its next engine process ahead) is done by then, and
does not slow the other server's measurement. Rounds alternate the servers, so each round's figures
share the machine's state; the report gives medians per model and folio's time over llama-server's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from folio.loaders.catalog import resolve_model
from folio_tools.bench.harness.flags import add_output_dir, command_line
from folio_tools.bench.harness.plots import figure, grouped_engine_bars
from folio_tools.bench.harness.table import row
from folio_tools.bench.peers.llama_cpp_build import build_llama_cpp
from folio_tools.bench.peers.llama_cpp_server import free_port, stop_process, wait_for_health
from folio_tools.bench.serve_compare.command import (
    STOP_GRACE_S,
    server_session,
    start_process,
    wait_until_ready,
)
from folio_tools.bench.serve_compare.peers import STARTUP_TIMEOUT_S
from folio_tools.results import machine_info, result_paths, write_json

PROMPT = "Write one sentence about the sea."
ENGINES = ("folio", "llama.cpp")
CONTEXT = 2048  # each model's context on both servers (llama-server's --ctx-size; folio's --max-model-len)


@dataclass(frozen=True)
class SwapBenchConfig:
    models: tuple[str, str] = ("smollm2-135m", "gemma3-270m")
    rounds: int = 5
    settle: float = 8.0  # idle seconds before each swap: what a load set going in the background finishes
    peer: bool = True
    llama_version: str | None = None
    output_dir: Path = Path("benchmarks/results")

    def __post_init__(self) -> None:
        if len(self.models) != 2 or self.models[0] == self.models[1]:
            raise ValueError(f"--models: two different models, got {list(self.models)}")
        if self.rounds < 1:
            raise ValueError(f"--rounds must be at least 1, got {self.rounds}")
        if self.settle < 0:
            raise ValueError(f"--settle must be >= 0 seconds, got {self.settle}")


@dataclass
class EngineTimes:
    command: str
    swap: dict[str, list[float]] = field(default_factory=dict)  # model -> seconds to the first token, per swap
    warm: dict[str, list[float]] = field(default_factory=dict)  # model -> the same, loaded already


def first_token_seconds(base_url: str, model: str, prompt: str = PROMPT) -> float:
    """Seconds from sending a streamed completion to its first token."""
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - start
    raise RuntimeError(f"{model}'s stream ended without a token")


def _start_folio(names: list[str], files: list[Path], log: Path, stack: ExitStack) -> tuple[str, str]:
    port = free_port()
    argv = [sys.executable, "-m", "folio.cli", "serve", *(f"{n}={f}" for n, f in zip(names, files, strict=True)),
            "--max-loaded-models", "1", "--keep-alive", "-1", "--max-model-len", str(CONTEXT),
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    process = start_process(argv, log)
    stack.callback(stop_process, process, STOP_GRACE_S)
    url = f"http://127.0.0.1:{port}"
    wait_until_ready("folio", url, process, STARTUP_TIMEOUT_S, log)
    return url, " ".join(argv)


def _start_router(config: SwapBenchConfig, folder: Path, log: Path, stack: ExitStack) -> tuple[str, str]:
    binaries = build_llama_cpp(version=config.llama_version)
    port = free_port()
    argv = [str(binaries.server), "--models-dir", str(folder), "--models-max", "1", "--ctx-size", str(CONTEXT),
            "--threads", "2", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    process = start_process(argv, log)
    stack.callback(stop_process, process, STOP_GRACE_S)
    url = f"http://127.0.0.1:{port}"
    wait_for_health(url, process, timeout=STARTUP_TIMEOUT_S, log_path=log)
    return url, " ".join(argv)


def run_swap_bench(config: SwapBenchConfig) -> dict[str, Any]:
    files = [resolve_model(model) for model in config.models]
    if any(f.suffix != ".gguf" for f in files):
        raise ValueError("folio bench swap needs GGUF models (llama-server's router loads them too)")
    names = [Path(model).name.removesuffix(".gguf") for model in config.models]
    date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    runs: dict[str, EngineTimes] = {}
    with server_session("folio-bench-swap-") as log_dir, tempfile.TemporaryDirectory(prefix="folio-swap-") as tmp:
        folder = Path(tmp)
        for name, file in zip(names, files, strict=True):  # the router names each model by its file's stem
            (folder / f"{name}.gguf").symlink_to(file)
        with ExitStack() as stack:
            urls = {}
            urls["folio"], command = _start_folio(names, files, log_dir / "folio.log", stack)
            runs["folio"] = EngineTimes(command)
            if config.peer:
                urls["llama.cpp"], command = _start_router(config, folder, log_dir / "llama.log", stack)
                runs["llama.cpp"] = EngineTimes(command)
            for url in urls.values():  # warm: each model loaded once (kernels built, files in the page cache)
                for name in (*names, names[0]):
                    first_token_seconds(url, name)
            for round_index in range(config.rounds):
                for name in (names[1], names[0]):  # the other model is loaded: each request is a swap
                    for engine, url in urls.items():
                        time.sleep(config.settle)
                        swap, warm = first_token_seconds(url, name), first_token_seconds(url, name)
                        runs[engine].swap.setdefault(name, []).append(swap)
                        runs[engine].warm.setdefault(name, []).append(warm)
                        print(f"round {round_index + 1}: {engine:9s} {name:14s} swap {swap:6.2f} s, "
                              f"loaded {warm * 1000:6.0f} ms", flush=True)  # fmt: skip
    return {"kind": "swap", "date_utc": date, "machine": machine_info(), "models": [str(f) for f in files],
            "config": {**asdict(config), "output_dir": str(config.output_dir)},
            "engines": {e: {"command": r.command, "swap_s": r.swap, "warm_s": r.warm} for e, r in runs.items()},
            "summary": summarize(runs, names)}  # fmt: skip


def summarize(runs: dict[str, EngineTimes], names: list[str]) -> dict[str, Any]:
    """Per engine and model: median seconds to the first token on a swap and loaded; per model, the
    median over rounds of folio's swap time over llama-server's."""
    summary: dict[str, Any] = {
        engine: {
            name: {"swap_s": statistics.median(r.swap[name]), "warm_s": statistics.median(r.warm[name])}
            for name in names
        }  # fmt: skip
        for engine, r in runs.items()
    }
    if "llama.cpp" in runs:
        summary["folio_over_llama_cpp"] = {
            name: statistics.median(
                f / ll for f, ll in zip(runs["folio"].swap[name], runs["llama.cpp"].swap[name], strict=True)
            )  # fmt: skip
            for name in names
        }
    return summary


def report(result: dict[str, Any], json_path: Path, png_path: Path) -> None:
    summary = result["summary"]
    engines = [e for e in ENGINES if e in summary]
    names = list(summary["folio"])
    print(row("model", names))
    for engine in engines:
        print(row(f"{engine} swap s", [summary[engine][n]["swap_s"] for n in names]))
        print(row(f"{engine} loaded s", [summary[engine][n]["warm_s"] for n in names]))
    if "folio_over_llama_cpp" in summary:
        print(row("folio / llama.cpp", [summary["folio_over_llama_cpp"][n] for n in names]))
    title = f"time to first token for a model not loaded (one held at a time), {result['date_utc']}"
    with figure(png_path, figsize=(8, 4), title=title) as (_, ax):
        values = {engine: [summary[engine][n]["swap_s"] for n in names] for engine in engines}
        grouped_engine_bars(ax, names, values, "%.2f s", "seconds to the first token (lower is better)")
    write_json(json_path, result)
    print(f"wrote {json_path} and {png_path}")


def run_swap_command(args: argparse.Namespace) -> int:
    try:
        models = tuple(args.models.split(","))
        if len(models) != 2:
            raise ValueError(f"--models: two models, comma-separated, got {args.models!r}")
        config = SwapBenchConfig((models[0], models[1]), args.rounds, args.settle, args.peer, args.llama_version,
                                 Path(args.output_dir))  # fmt: skip
        result = run_swap_bench(config)
    except (ValueError, RuntimeError, httpx.HTTPError) as exc:  # ServerError and LlamaCppBuildError among them
        print(f"error: {exc}", file=sys.stderr)
        return 1
    result["command"] = command_line(args, positionals=())
    json_path, png_path = result_paths(config.output_dir, "swap", "-".join(config.models), result["date_utc"])
    report(result, json_path, png_path)
    return 0


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "swap",
        help="time to first token for a model not loaded: folio serve vs llama-server's router mode",
        description=__doc__.split("\n\n")[0].replace("\n", " ") if __doc__ else None,
    )
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m", help="two catalog names or .gguf files, "
                        "comma-separated (default smollm2-135m,gemma3-270m)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5, help="swaps to each model per server (default 5)")
    parser.add_argument("--settle", type=float, default=8.0, help="idle seconds before each swap (default 8)")
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="folio only (no llama-server)")
    parser.add_argument("--llama-version", default=None, help="llama-cpp-python version (default: the installed build)")
    add_output_dir(parser)
    parser.set_defaults(bench_run=run_swap_command)
