"""`folio bench lora`: output tok/s of one batch of requests spread over 0 (the base model), 1, 4 and 16
LoRA adapters, folio serve beside llama-server with the same adapters, in alternating rounds.

Both servers load the same GGUF base model and the same seeded random adapters (rank 16 on every
projection by default): folio the PEFT folders (`--lora-modules`), llama.cpp the GGUF files its own
converter makes of them (`--lora ... --lora-init-without-apply`, each request choosing its adapter with
`lora: [{"id": k, "scale": 1}]`). A measurement sends `--batch` requests at once, request i on adapter
i mod N, each of `--max-tokens` tokens with EOS ignored, and divides the tokens by the time until the
last one ends. Every round measures each adapter count on folio and then on llama-server, so a round's
figures share the machine's state; the report gives medians over rounds, each engine's rate against its
own base model in the same round, and folio's against llama-server's. Prefix caching is off on both.

llama.cpp's base model is measured on a second llama-server started without adapters: the one holding
them runs base requests (every adapter at scale 0) slower than one adapter's (measured: 73 vs 99 tok/s
at batch 16 on smollm2-135m), which would flatter its ratios; that figure is kept in the report too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
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
from folio_tools.bench.lora.adapters import base_config, make_adapter
from folio_tools.bench.peers.llama_cpp_build import build_llama_cpp
from folio_tools.bench.peers.llama_cpp_lora import convert_lora, lora_converter
from folio_tools.bench.peers.llama_cpp_server import free_port, start_llama_server, stop_process, wait_for_health
from folio_tools.bench.serve_compare.command import (
    STOP_GRACE_S,
    server_session,
    start_process,
    wait_until_ready,
)
from folio_tools.bench.serve_compare.peers import STARTUP_TIMEOUT_S
from folio_tools.results import machine_info, result_paths, write_json

PROMPT = "Request {i}: tell the story of a lighthouse keeper who finds a message in a bottle."
ENGINES = ("folio", "llama.cpp")
LOADED_BASE = "llama.cpp, adapters loaded"  # llama.cpp's base model on the server holding the adapters


@dataclass(frozen=True)
class LoRABenchConfig:
    model: str
    counts: tuple[int, ...] = (1, 4, 16)  # adapters mixed in one batch (0, the base model, is always measured)
    batch: int = 16
    max_tokens: int = 64
    rank: int = 16
    rounds: int = 3
    lora_dtype: str = "float32"  # the adapters' matrices, on both servers
    peer: bool = True
    llama_version: str | None = None
    output_dir: Path = Path("benchmarks/results")

    def __post_init__(self) -> None:
        if not self.counts or min(self.counts) < 1:
            raise ValueError(f"--adapters: counts of at least 1, got {list(self.counts)}")
        for name in ("batch", "max_tokens", "rank", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")


@dataclass
class EngineRuns:
    command: str
    rates: dict[int, list[float]] = field(default_factory=dict)  # adapters -> output tok/s, one per round


def run_batch(base_url: str, bodies: list[dict[str, Any]]) -> float:
    """Output tok/s of `bodies` sent at once to /v1/completions: their tokens over the time to the last."""
    with httpx.Client(base_url=base_url, timeout=600) as client, ThreadPoolExecutor(len(bodies)) as pool:
        start = time.perf_counter()
        answers = list(pool.map(lambda body: client.post("/v1/completions", json=body), bodies))
        seconds = time.perf_counter() - start
    tokens = 0
    for answer in answers:
        answer.raise_for_status()
        tokens += answer.json()["usage"]["completion_tokens"]
    return tokens / seconds


def folio_bodies(config: LoRABenchConfig, base_name: str, adapters: int) -> list[dict[str, Any]]:
    return [{"model": f"a{i % adapters}" if adapters else base_name, "prompt": PROMPT.format(i=i),
             "max_tokens": config.max_tokens, "temperature": 0, "ignore_eos": True}
            for i in range(config.batch)]  # fmt: skip


def llama_bodies(config: LoRABenchConfig, adapters: int) -> list[dict[str, Any]]:
    return [{"prompt": PROMPT.format(i=i), "max_tokens": config.max_tokens, "temperature": 0, "ignore_eos": True,
             "cache_prompt": False, "lora": [{"id": i % adapters, "scale": 1.0}] if adapters else []}
            for i in range(config.batch)]  # fmt: skip


def _start_folio(
    config: LoRABenchConfig, model: Path, adapters: list[Path], log: Path, stack: ExitStack
) -> tuple[str, str]:
    port = free_port()
    argv = [sys.executable, "-m", "folio.cli", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--lora-modules", *(f"a{i}={path}" for i, path in enumerate(adapters)),
            "--max-loras", str(len(adapters)), "--max-lora-rank", str(config.rank),
            "--max-num-seqs", str(config.batch), "--no-prefix-caching", "--lora-dtype", config.lora_dtype]  # fmt: skip
    process = start_process(argv, log)
    stack.callback(stop_process, process, STOP_GRACE_S)
    url = f"http://127.0.0.1:{port}"
    wait_until_ready("folio", url, process, STARTUP_TIMEOUT_S, log)
    return url, " ".join(argv)


def _start_llama(
    config: LoRABenchConfig, model: Path, ggufs: list[Path], log: Path, stack: ExitStack
) -> tuple[str, str]:
    """llama-server with `ggufs` loaded at scale 0 (none: the base model alone)."""
    binaries = build_llama_cpp(version=config.llama_version)
    port = free_port()
    context = config.batch * (config.max_tokens + 128)  # each slot: the prompt and its output, with room
    extra = [arg for path in ggufs for arg in ("--lora", str(path))] + ["--lora-init-without-apply"] * bool(ggufs)
    process = start_llama_server(binaries, model, port, ctx_size=context, parallel=config.batch, extra_args=extra,
                                 log_path=log)  # fmt: skip
    stack.callback(stop_process, process)
    url = f"http://127.0.0.1:{port}"
    wait_for_health(url, process, timeout=STARTUP_TIMEOUT_S, log_path=log)
    return url, f"{binaries.server} --model {model} --parallel {config.batch} --ctx-size {context} " + " ".join(extra)


def _served_name(url: str) -> str:
    models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return next(m["id"] for m in models if not m.get("parent"))


def run_lora_bench(config: LoRABenchConfig) -> dict[str, Any]:
    model = resolve_model(config.model)
    if model.suffix != ".gguf":
        raise ValueError("folio bench lora needs a GGUF model (llama.cpp serves it too)")
    date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    most = max(config.counts)
    runs: dict[str, EngineRuns] = {}
    with server_session("folio-bench-lora-") as log_dir, tempfile.TemporaryDirectory(prefix="folio-lora-") as tmp:
        work = Path(tmp)
        hf = base_config(model, work / "base")
        print(f"making {most} rank-{config.rank} adapters on every projection of {model.name}", flush=True)
        adapters = [make_adapter(hf, work / f"a{i}", config.rank, seed=1000 + i) for i in range(most)]
        with ExitStack() as stack:
            urls: dict[str, str] = {}
            urls["folio"], command = _start_folio(config, model, adapters, log_dir / "folio.log", stack)
            runs["folio"] = EngineRuns(command)
            base_name = _served_name(urls["folio"])
            measures = {"folio": lambda n: run_batch(urls["folio"], folio_bodies(config, base_name, n))}
            if config.peer:
                converter = lora_converter(build_llama_cpp(version=config.llama_version))
                print(f"converting the adapters with llama.cpp's {converter.name}/convert_lora_to_gguf.py", flush=True)
                outtype = {"float32": "f32", "bfloat16": "bf16"}[config.lora_dtype]
                ggufs = [convert_lora(converter, a, work / "base", work / f"{a.name}.gguf", outtype) for a in adapters]
                urls["llama.cpp"], command = _start_llama(config, model, ggufs, log_dir / "llama.log", stack)
                urls["llama.cpp base"], base_command = _start_llama(config, model, [], log_dir / "base.log", stack)
                runs["llama.cpp"] = EngineRuns(f"{command}; base model: {base_command}")
                runs[LOADED_BASE] = EngineRuns(command)
                measures["llama.cpp"] = lambda n: run_batch(urls["llama.cpp" if n else "llama.cpp base"],
                                                            llama_bodies(config, n))  # fmt: skip
                measures[LOADED_BASE] = lambda n: run_batch(urls["llama.cpp"], llama_bodies(config, 0))
            counts = (0, *config.counts)
            for engine, measure in measures.items():  # warm: kernels, adapters into their slots
                for n in counts if engine != LOADED_BASE else (0,):
                    measure(n)
            for round_index in range(config.rounds):
                for n in counts:
                    for engine, measure in measures.items():
                        if engine == LOADED_BASE and n:
                            continue
                        rate = measure(n)
                        runs[engine].rates.setdefault(n, []).append(rate)
                        print(f"round {round_index + 1}: {engine:9s} {n:2d} adapters {rate:7.1f} tok/s", flush=True)
    return {"kind": "lora", "date_utc": date, "machine": machine_info(), "model": str(model),
            "config": {**asdict(config), "output_dir": str(config.output_dir)},
            "engines": {name: {"command": r.command, "rates": r.rates} for name, r in runs.items()},
            "summary": summarize(runs, counts)}  # fmt: skip


def summarize(runs: dict[str, EngineRuns], counts: tuple[int, ...]) -> dict[str, Any]:
    """Per engine and adapter count: the median rate, and the median over rounds of its ratio to the same
    engine's base model; per count, the median over rounds of folio's rate over llama-server's."""
    summary: dict[str, Any] = {}
    if LOADED_BASE in runs:
        summary[LOADED_BASE] = {0: {"tok_s": statistics.median(runs[LOADED_BASE].rates[0])}}
    for name, run in runs.items():
        if name == LOADED_BASE:
            continue
        base = run.rates[0]
        summary[name] = {n: {"tok_s": statistics.median(run.rates[n]),
                             "vs_base": statistics.median(r / b for r, b in zip(run.rates[n], base, strict=True))}
                         for n in counts}  # fmt: skip
    if "llama.cpp" in runs:
        pairs = {n: zip(runs["folio"].rates[n], runs["llama.cpp"].rates[n], strict=True) for n in counts}
        summary["folio_vs_llama_cpp"] = {n: statistics.median(f / ll for f, ll in pairs[n]) for n in counts}
    return summary


def report(result: dict[str, Any], json_path: Path, png_path: Path) -> None:
    summary = result["summary"]
    engines = [e for e in ENGINES if e in summary]
    counts = list(summary["folio"])
    print(row("adapters", [str(n) if n else "base" for n in counts]))
    for engine in engines:
        print(row(f"{engine} tok/s", [summary[engine][n]["tok_s"] for n in counts]))
        print(row(f"{engine} vs base", [summary[engine][n]["vs_base"] for n in counts]))
    if "folio_vs_llama_cpp" in summary:
        print(row("folio / llama.cpp", [summary["folio_vs_llama_cpp"][n] for n in counts]))
        print(
            f"llama.cpp's base model on the server holding the adapters: {summary[LOADED_BASE][0]['tok_s']:.1f} tok/s"
        )
    config = result["config"]
    title = (f"LoRA: {config['batch']} requests x {config['max_tokens']} tokens, rank {config['rank']} "
             f"{config['lora_dtype']} on every projection, {Path(result['model']).name}, "
             f"{result['date_utc']}")  # fmt: skip
    with figure(png_path, figsize=(8, 4), title=title) as (_, ax):
        groups = ["base" if n == 0 else f"{n} adapter{'s' * (n > 1)}" for n in counts]
        values = {engine: [summary[engine][n]["tok_s"] for n in counts] for engine in engines}
        grouped_engine_bars(ax, groups, values, "%.0f", "output tok/s")
    write_json(json_path, result)
    print(f"wrote {json_path} and {png_path}")


def run_lora_command(args: argparse.Namespace) -> int:
    try:
        config = LoRABenchConfig(
            args.model, tuple(int(n) for n in args.adapters.split(",")), args.batch, args.max_tokens, args.rank,
            args.rounds, args.lora_dtype, args.peer, args.llama_version, Path(args.output_dir),
        )  # fmt: skip
        result = run_lora_bench(config)
    except (ValueError, RuntimeError, httpx.HTTPError) as exc:  # ServerError and LlamaCppBuildError among them
        print(f"error: {exc}", file=sys.stderr)
        return 1
    result["command"] = command_line(args)
    json_path, png_path = result_paths(config.output_dir, "lora", config.model, result["date_utc"], config.lora_dtype)
    report(result, json_path, png_path)
    return 0


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "lora",
        help="LoRA adapters mixed in one batch: folio serve vs llama-server with the same adapters",
        description=__doc__.split("\n\n")[0].replace("\n", " ") if __doc__ else None,
    )
    parser.add_argument("model", nargs="?", default="smollm2-135m", help="catalog name or Llama-family .gguf file")
    parser.add_argument("--adapters", default="1,4,16", help="adapter counts to mix, comma-separated (default 1,4,16)")
    parser.add_argument("--batch", type=int, default=16, help="requests sent at once (default 16)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates (default 64)")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank (default 16)")
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each engine and count (default 3)")
    parser.add_argument("--lora-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the adapters' matrices on both servers (default float32)")  # fmt: skip
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="folio only (no llama.cpp server)")
    parser.add_argument("--llama-version", default=None, help="llama-cpp-python version (default: the installed build)")
    add_output_dir(parser)
    parser.set_defaults(bench_run=run_lora_command)
