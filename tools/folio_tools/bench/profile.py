"""`folio bench profile`: where a decode step's (or, `--prefill`, a prompt pass's) time goes, on the CPU
or a GPU.

`--batch` requests (random prompts of `--prompt-tokens` tokens, decoding with ignore_eos) are run into
decode, then the same `--steps` pure decode steps are measured three ways, one after the other, after
a few warm-up steps. With `--prefill`, each of the `--steps` is instead a pass that prefills `--batch`
fresh random prompts (none hits the prefix cache) up to their first token, after one warm-up pass.
The three ways:
- timed alone (each step's wall time, the device synchronized before and after);
- under torch.profiler: the aten ops (and on a GPU, its kernels) by their own time, and, on a GPU, how
  long the device was busy per step: a step whose wall time is far above that is bound by the host;
- under cProfile: folio's Python functions by their time per step, inclusive and exclusive.
The profilers slow a step down; their tables say where the time goes, the timed pass what it is. On the
CPU folio's C++ kernels are not torch ops: their time shows in the functions table (inclusive, under
the Python functions that call them, e.g. `PackedInt4.linear`), not in the ops table.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import folio
from folio import LLM, SamplingParams
from folio.engine.request import Request
from folio.engine_args import EngineArgs
from folio.loaders.catalog import resolve_model
from folio.platform import default_threads
from folio_tools.bench.harness.flags import add_output_dir, command_line
from folio_tools.bench.harness.plots import figure
from folio_tools.bench.harness.prefill import random_prompt
from folio_tools.results import machine_info, result_paths, write_json

WARM_UP_STEPS = 4  # the first decode steps of a batch run cold (allocations, a CUDA graph's capture)
TOP = 25  # rows kept in each table
FOLIO_SOURCE = str(Path(folio.__file__).resolve().parent)  # the runtime's functions, in cProfile's table


@dataclass
class ProfileConfig:
    model: str
    batch: int = 1
    prompt_tokens: int = 128
    steps: int = 20
    engine_args: dict[str, Any] = field(default_factory=dict)
    prefill: bool = False  # each step a pass prefilling the batch's prompts, not a decode step


@dataclass(frozen=True)
class OpTime:
    name: str
    calls_per_step: float
    host_us_per_step: float  # self time on the host (the CPU op, or a kernel's launch)
    device_us_per_step: float  # self time on the GPU (0 on the CPU)


@dataclass(frozen=True)
class FunctionTime:
    function: str  # file:line(name), folio-relative
    calls_per_step: float
    inclusive_us_per_step: float
    exclusive_us_per_step: float


@dataclass
class ProfileReport:
    command: str
    date_utc: str
    model: str
    device: str
    dtype: str
    config: dict[str, Any]
    step_ms: list[float]  # the timed pass, each step (with --prefill: each prompt pass)
    median_step_ms: float
    device_busy_ms_per_step: float | None  # GPU only: the kernels' time over the profiled steps
    ops: list[OpTime]
    functions: list[FunctionTime]
    machine: dict[str, Any] = field(default_factory=machine_info)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _start_decoding(llm: LLM, config: ProfileConfig) -> list[Request]:
    """Submit the batch and step until every request has its first token (its prompt done). Each may
    decode up to the context length, so that none finishes before the measured steps end."""
    room = llm.engine.max_model_len - config.prompt_tokens
    if room < WARM_UP_STEPS + 3 * config.steps + 1:
        raise ValueError(f"{config.prompt_tokens}-token prompts leave {room} tokens of the context length for "
                         f"{WARM_UP_STEPS + 3 * config.steps + 1} decode steps")  # fmt: skip
    params = SamplingParams(max_tokens=room, temperature=0, ignore_eos=True)
    eos = frozenset(llm.model_config.eos_token_ids)
    requests = [Request(f"profile-{i}", random_prompt(llm, config.prompt_tokens, seed=i), params, eos)
                for i in range(config.batch)]  # fmt: skip
    for request in requests:
        llm.engine.add_request(request)
    while llm.engine.has_unfinished() and any(not r.output_token_ids for r in requests):
        llm.engine.step()
    if any(not r.output_token_ids for r in requests):
        raise RuntimeError("a request of the batch ended before its first token")
    return requests


def _decode_steps(llm: LLM, steps: int, batch: int, device: torch.device) -> list[float]:
    """Run `steps` engine steps; each one's wall time in ms. Each must decode the whole batch."""
    times = []
    for _ in range(steps):
        _synchronize(device)
        start = time.perf_counter()
        llm.engine.step()
        _synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
        ran = llm.engine.last_step
        if ran is None or ran.num_running != batch or ran.num_waiting or ran.num_preempted:
            raise RuntimeError(
                f"{ran.num_running if ran else 0} of {batch} requests ran in a measured step (others waited or "
                "were preempted): the KV cache is too small for this batch (--kv-cache-memory)"
            )
    return times


def _prefill_passes(llm: LLM, config: ProfileConfig, passes: int, seeds: Iterator[int]) -> list[float]:
    """Run `passes` passes, each prefilling `config.batch` fresh random prompts (seeds never repeat, so
    no prompt finds its blocks in the prefix cache) to their first token; each pass's wall time in ms."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    eos = frozenset(llm.model_config.eos_token_ids)
    times = []
    for _ in range(passes):
        requests = []
        for _ in range(config.batch):
            seed = next(seeds)
            prompt = random_prompt(llm, config.prompt_tokens, seed=seed)
            requests.append(Request(f"profile-prefill-{seed}", prompt, params, eos))
        _synchronize(llm.device)
        start = time.perf_counter()
        for request in requests:
            llm.engine.add_request(request)
        while llm.engine.has_unfinished():
            llm.engine.step()
        _synchronize(llm.device)
        times.append((time.perf_counter() - start) * 1e3)
        if any(request.num_cached_tokens for request in requests):
            raise RuntimeError("a random prompt hit the prefix cache: the pass would not be a prefill")
    return times


def _op_table(prof: profile, steps: int) -> tuple[list[OpTime], float | None]:
    """The ops and kernels by their time per step, and the device's busy ms per step (None on the CPU).
    An eager op's device time is that of the kernels it launched, which are rows of their own: the busy
    time sums the kernels alone."""
    events = prof.key_averages()
    ops = [
        OpTime(e.key, e.count / steps, e.self_cpu_time_total / steps, e.self_device_time_total / steps) for e in events
    ]
    kernels_us = sum(e.self_device_time_total for e in events if e.device_type != DeviceType.CPU)
    busy = kernels_us / steps / 1e3 if kernels_us else None
    ops.sort(key=lambda op: op.host_us_per_step + op.device_us_per_step, reverse=True)
    return ops[:TOP], busy


def _function_table(profiler: cProfile.Profile, steps: int) -> list[FunctionTime]:
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    found = []
    for (filename, line, name), (_, calls, exclusive, inclusive, _) in stats.items():
        if not filename.startswith(FOLIO_SOURCE):
            continue
        where = f"{Path(filename).relative_to(FOLIO_SOURCE)}:{line}({name})"
        found.append(FunctionTime(where, calls / steps, inclusive * 1e6 / steps, exclusive * 1e6 / steps))
    found.sort(key=lambda f: f.inclusive_us_per_step, reverse=True)
    return found[:TOP]


def run_profile(config: ProfileConfig, command: str) -> ProfileReport:
    if config.batch < 1 or config.steps < 1 or config.prompt_tokens < 1:
        raise ValueError("--batch, --steps and --prompt-tokens must be at least 1")
    torch.set_num_threads(default_threads())
    llm = LLM(resolve_model(config.model), **config.engine_args)
    try:
        device = llm.device
        date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        requests = [] if config.prefill else _start_decoding(llm, config)
        seeds = itertools.count()

        def measure(steps: int) -> list[float]:
            if config.prefill:
                return _prefill_passes(llm, config, steps, seeds)
            return _decode_steps(llm, steps, config.batch, device)

        measure(1 if config.prefill else WARM_UP_STEPS)  # warm-up
        step_ms = measure(config.steps)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            measure(config.steps)
        ops, busy = _op_table(prof, config.steps)
        profiler = cProfile.Profile()
        profiler.enable()
        measure(config.steps)
        profiler.disable()
        functions = _function_table(profiler, config.steps)
        for request in requests:
            llm.engine.abort_request(request.request_id)
    finally:
        llm.close()
    settings = {k: v for k, v in asdict(config).items() if k != "model"}
    dtype = str(llm.dtype).removeprefix("torch.")
    return ProfileReport(command, date, config.model, str(device), dtype, settings, step_ms,
                         statistics.median(step_ms), busy, ops, functions)  # fmt: skip


def _what_was_measured(report: ProfileReport) -> str:
    config = report.config
    if config["prefill"]:
        return f"prefill of {config['batch']} x {config['prompt_tokens']}-token prompts"
    return f"batch {config['batch']}"


def format_tables(report: ProfileReport) -> str:
    lines = [f"{report.model} on {report.device} ({report.dtype}), {_what_was_measured(report)}: "
             f"median step {report.median_step_ms:.2f} ms"]  # fmt: skip
    if report.config["prefill"]:
        tokens = report.config["batch"] * report.config["prompt_tokens"]
        lines.append(f"(a step is a prompt pass: {tokens / report.median_step_ms * 1e3:.0f} prompt tok/s)")
    if report.device_busy_ms_per_step is not None:
        share = report.device_busy_ms_per_step / report.median_step_ms
        lines.append(f"device busy {report.device_busy_ms_per_step:.2f} ms per step ({share:.0%} of the step)")
    lines.append(f"\n{'op':<48} {'calls':>7} {'host us':>9} {'device us':>10}")
    for op in report.ops:
        lines.append(f"{op.name[:48]:<48} {op.calls_per_step:>7.1f} {op.host_us_per_step:>9.1f} "
                     f"{op.device_us_per_step:>10.1f}")  # fmt: skip
    lines.append(f"\n{'folio function':<64} {'calls':>7} {'incl us':>9} {'excl us':>9}")
    for f in report.functions:
        lines.append(f"{f.function[-64:]:<64} {f.calls_per_step:>7.1f} {f.inclusive_us_per_step:>9.1f} "
                     f"{f.exclusive_us_per_step:>9.1f}")  # fmt: skip
    return "\n".join(lines)


def _plot(report: ProfileReport, path: Path) -> None:
    step = "a prompt pass's" if report.config["prefill"] else "a decode step's"
    title = f"{report.model} on {report.device}, {_what_was_measured(report)}: {step} time"
    with figure(path, ncols=2, figsize=(12, 5), title=title) as (_, (ops_ax, fn_ax)):
        ops = report.ops[:12][::-1]
        ops_ax.barh([o.name[:32] for o in ops], [o.host_us_per_step for o in ops], label="host")
        ops_ax.barh([o.name[:32] for o in ops], [o.device_us_per_step for o in ops],
                    left=[o.host_us_per_step for o in ops], label="device")  # fmt: skip
        ops_ax.set_xlabel("us per step (self)")
        ops_ax.legend(fontsize=7)
        ops_ax.tick_params(axis="y", labelsize=6)
        functions = report.functions[:12][::-1]
        fn_ax.barh([f.function[-40:] for f in functions], [f.inclusive_us_per_step for f in functions])
        fn_ax.set_xlabel("us per step (inclusive, under cProfile)")
        fn_ax.tick_params(axis="y", labelsize=6)


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "profile",
        help="where a decode step's (or a prefill's) time goes: aten ops and GPU kernels, folio's Python functions",
        description="Run --batch requests into decode and profile --steps pure decode steps: timed alone, under "
        "torch.profiler (ops, kernels, the GPU's busy time) and under cProfile (folio's functions). With "
        "--prefill, each step is a pass that prefills --batch fresh prompts instead.",
    )
    parser.add_argument("model", help="catalog name, .gguf file or Hugging Face model folder")
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together (default 1)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="each request's prompt (default 128)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps in each pass (default 20)")
    parser.add_argument(
        "--prefill", action="store_true", help="profile prompt passes: each prefills --batch fresh prompts"
    )
    add_output_dir(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(bench_run=run_profile_command)


def run_profile_command(args: argparse.Namespace) -> int:
    engine = EngineArgs.from_cli_args(args).llm_kwargs()
    config = ProfileConfig(args.model, args.batch, args.prompt_tokens, args.steps, engine, args.prefill)
    report = run_profile(config, command_line(args))
    print(format_tables(report))
    kind = f"prefill{config.prompt_tokens}x{config.batch}" if config.prefill else f"batch{config.batch}"
    json_path, png_path = result_paths(Path(args.output_dir), "profile", report.model, report.date_utc,
                                       report.dtype, kind)  # fmt: skip
    write_json(json_path, report.to_dict())
    _plot(report, png_path)
    print(f"wrote {json_path}")
    print(f"wrote {png_path}")
    return 0
