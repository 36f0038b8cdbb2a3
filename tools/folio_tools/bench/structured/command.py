"""`folio bench structured`: what enforcing a JSON schema costs.

The same chat requests run twice on one engine: first constrained by a JSON schema (token masks from
llguidance), then unconstrained, each request forced (EOS ignored) to decode exactly as many tokens
as its constrained run produced. Same prompts, same seeds, same token counts: the throughput ratio is
the cost of the constraint, and the runner's mask timing says how much of it is computing masks.
Every constrained output is checked to parse and validate against its schema.
Each run's MFU (roofline.py) is its requests' FLOPs (prompt and output tokens each) over its wall time,
against the machine's matmul peak measured as the run starts in the run's --dtype; the requests run
batched, so bandwidth (MBU) is not the figure that bounds them and is not reported. The peer's prompts are
counted with folio's tokenizer and chat template (the same GGUF file's).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from folio import LLM, SamplingParams
from folio.engine_args import EngineArgs
from folio.loaders.catalog import resolve_model
from folio.platform import default_device, default_threads, resolve_dtype
from folio.structured.params import StructuredOutputParams
from folio_tools.bench.harness.flags import add_output_dir, command_line
from folio_tools.bench.harness.plots import FOLIO_COLOR, PEER_COLOR, figure
from folio_tools.bench.harness.roofline import MachinePeaks, TokenCost, measure_peaks
from folio_tools.bench.harness.table import percent, row
from folio_tools.bench.structured.llama import count_valid, run_llama_structured
from folio_tools.bench.structured.schemas import SCHEMAS
from folio_tools.results import machine_info, result_paths, write_json

PEERS = ("llama.cpp",)
Chat = list[dict[str, str]]


@dataclass
class StructuredConfig:
    model: str
    num_prompts: int = 32
    max_tokens: int = 256
    temperature: float = 0.7
    seed: int = 0
    peer: str | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of folio.LLM

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.max_tokens < 1:
            raise ValueError("--num-prompts and --max-tokens must be at least 1")


@dataclass
class RunResult:
    name: str  # "json_schema" or "unconstrained"
    elapsed_s: float
    output_tokens: int
    num_steps_masked: int = 0
    num_masks: int = 0
    mask_s: float = 0.0
    mfu: float | None = None  # a fraction of the matmul peak: the requests' FLOPs over elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def mask_ms_per_step(self) -> float:
        return 1000 * self.mask_s / self.num_steps_masked if self.num_steps_masked else 0.0

    @property
    def mask_ms_per_row(self) -> float:
        return 1000 * self.mask_s / self.num_masks if self.num_masks else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "output_tokens_per_s": self.output_tokens_per_s,
                "mask_ms_per_step": self.mask_ms_per_step, "mask_ms_per_row": self.mask_ms_per_row}  # fmt: skip


@dataclass
class EngineStructured:
    """One engine's pair of runs over the workload."""

    engine: str
    constrained: RunResult
    unconstrained: RunResult
    num_valid: int  # constrained outputs that parse and validate against their schema
    num_finished: int  # constrained outputs that ended by themselves (not cut by max_tokens)

    @property
    def throughput_ratio(self) -> float:
        """Constrained / unconstrained output tokens per second (1.0: the constraint is free)."""
        return self.constrained.output_tokens_per_s / self.unconstrained.output_tokens_per_s

    @property
    def mask_share(self) -> float:
        """Fraction of the constrained run's wall time spent computing masks (folio measures it)."""
        return self.constrained.mask_s / self.constrained.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "throughput_ratio": self.throughput_ratio, "mask_share": self.mask_share,
                "num_valid": self.num_valid, "num_finished": self.num_finished,
                "constrained": self.constrained.to_dict(), "unconstrained": self.unconstrained.to_dict()}  # fmt: skip


@dataclass
class StructuredReport:
    command: str
    date_utc: str
    model: str
    dtype: str
    config: dict[str, Any]
    results: list[EngineStructured]  # folio first, then the peer if any
    peer_info: dict[str, Any] = field(default_factory=dict)
    peaks: dict[str, Any] = field(default_factory=dict)  # roofline.MachinePeaks, measured as the run started
    machine: dict[str, Any] = field(default_factory=machine_info)

    def to_dict(self) -> dict[str, Any]:
        return {"command": self.command, "date_utc": self.date_utc, "model": self.model, "dtype": self.dtype,
                "config": self.config, "machine": self.machine, "peer_info": self.peer_info, "peaks": self.peaks,
                "results": [r.to_dict() for r in self.results]}  # fmt: skip


def conversations(num_prompts: int) -> list[tuple[str, list[dict[str, str]]]]:
    """(schema name, chat) pairs, cycling through the schemas."""
    names = sorted(SCHEMAS)
    chats = []
    for i in range(num_prompts):
        name = names[i % len(names)]
        chats.append((name, [{"role": "user", "content": f"Example {i + 1}: give me a realistic {name} as JSON."}]))
    return chats


def is_valid(text: str, schema: dict[str, Any]) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_structured(config: StructuredConfig, command: str) -> StructuredReport:
    import gc

    if config.peer is not None and config.peer not in PEERS:
        raise ValueError(f"unknown peer {config.peer!r}; choose from {', '.join(PEERS)}")
    date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    path = resolve_model(config.model)
    if config.peer == "llama.cpp" and path.suffix != ".gguf":
        raise ValueError(f"--peer llama.cpp needs a GGUF model, and {config.model} is {path}")
    torch.set_num_threads(default_threads())
    peaks = measure_peaks(
        resolve_dtype(config.engine_args.get("dtype") or "float32", default_device())[0]
    )  # before the model loads
    llm = LLM(path, **config.engine_args)
    torch.set_num_threads(default_threads())
    cost = TokenCost.of(path, llm.loaded.step_weight_bytes(config.temperature == 0), llm.engine.kv_bytes_per_token)
    chats = conversations(config.num_prompts)
    prompts = [llm.tokenizer.encode_chat(chat) for _, chat in chats]
    prompt_lens = [len(p) for p in prompts]
    results = [_run_folio(llm, config, chats, prompts, cost, peaks)]
    dtype = str(llm.dtype).removeprefix("torch.")
    del llm  # free folio's weights and KV pool before the peer loads its own copy
    gc.collect()
    peer_info: dict[str, Any] = {}
    if config.peer == "llama.cpp":
        longest = max(len(p) for p in prompts)
        bound, free, peer_info = run_llama_structured(path, chats, longest, config.max_tokens, config.temperature,
                                                      config.seed, threads=default_threads())  # fmt: skip
        bound_mfu = cost.requests_mfu(zip(prompt_lens, bound.completion_tokens, strict=True), bound.elapsed_s, peaks)
        free_mfu = cost.requests_mfu(zip(prompt_lens, free.completion_tokens, strict=True), free.elapsed_s, peaks)
        results.append(EngineStructured(
            "llama.cpp",
            RunResult("json_schema", bound.elapsed_s, sum(bound.completion_tokens), mfu=bound_mfu),
            RunResult("unconstrained", free.elapsed_s, sum(free.completion_tokens), mfu=free_mfu),
            count_valid(bound, chats, is_valid),
            sum(reason == "stop" for reason in bound.finish_reasons),
        ))  # fmt: skip
    settings = {k: v for k, v in asdict(config).items() if k != "model"}
    return StructuredReport(command, date, config.model, dtype, settings, results, peer_info, peaks.to_dict())


def _run_folio(
    llm: Any,
    config: StructuredConfig,
    chats: list[tuple[str, Chat]],
    prompts: list[list[int]],
    cost: TokenCost,
    peaks: MachinePeaks,
) -> EngineStructured:
    # Warm up both paths (first-call allocations, llguidance's tokenizer index) outside the timings.
    warm = StructuredOutputParams(json=SCHEMAS[chats[0][0]])
    llm.generate(prompts[:2], [SamplingParams(max_tokens=8, structured_output=warm), SamplingParams(max_tokens=8)],
                 use_tqdm=False)  # fmt: skip
    before = llm.engine.make_stats().mask_timing
    bound_params = [
        SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature, seed=config.seed + i,
                       structured_output=StructuredOutputParams(json=SCHEMAS[name]))
        for i, (name, _) in enumerate(chats)
    ]  # fmt: skip
    start = time.perf_counter()
    outputs = llm.generate(prompts, bound_params)
    elapsed = time.perf_counter() - start
    after = llm.engine.make_stats().mask_timing
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    prompt_lens = [len(p) for p in prompts]
    constrained = RunResult("json_schema", elapsed, sum(lengths), after.num_steps - before.num_steps,
                            after.num_masks - before.num_masks, after.seconds - before.seconds,
                            cost.requests_mfu(zip(prompt_lens, lengths, strict=True), elapsed, peaks))  # fmt: skip
    num_valid = sum(is_valid(o.outputs[0].text, SCHEMAS[name]) for o, (name, _) in zip(outputs, chats, strict=True))
    num_finished = sum(o.outputs[0].finish_reason == "stop" for o in outputs)

    free_params = [
        SamplingParams(max_tokens=n, temperature=config.temperature, seed=config.seed + i, ignore_eos=True)
        for i, n in enumerate(lengths)
    ]
    start = time.perf_counter()
    free = llm.generate(prompts, free_params)
    elapsed = time.perf_counter() - start
    free_lengths = [len(o.outputs[0].token_ids) for o in free]
    free_mfu = cost.requests_mfu(zip(prompt_lens, free_lengths, strict=True), elapsed, peaks)
    unconstrained = RunResult("unconstrained", elapsed, sum(free_lengths), mfu=free_mfu)
    if unconstrained.output_tokens != constrained.output_tokens:
        raise RuntimeError("the unconstrained run decoded a different number of tokens than the constrained one")
    return EngineStructured("folio", constrained, unconstrained, num_valid, num_finished)


def format_table(report: StructuredReport) -> str:
    widths = [12, 12, 8, 14, 8, 8, 12, 12]
    labels = ["json tok/s", "free tok/s", "ratio", "mask ms/step", "valid", "ended", "json MFU %", "free MFU %"]
    lines = [row("engine", labels, 10, widths)]
    total = report.config["num_prompts"]
    for r in report.results:
        mask = f"{r.constrained.mask_ms_per_step:.3f}" if r.constrained.num_steps_masked else None
        values = [r.constrained.output_tokens_per_s, r.unconstrained.output_tokens_per_s, f"{r.throughput_ratio:.3f}x",
                  mask, f"{r.num_valid}/{total}", f"{r.num_finished}/{total}", percent(r.constrained.mfu),
                  percent(r.unconstrained.mfu)]  # fmt: skip
        lines.append(row(r.engine, values, 10, widths, number=".1f"))
    folio = report.results[0]
    lines.append(
        f"ratio = constrained/unconstrained throughput on the same token counts; folio's masks took "
        f"{100 * folio.mask_share:.1f}% of its constrained run ({folio.constrained.mask_ms_per_row:.3f} ms per row)"
    )
    peaks = report.peaks
    if peaks:
        lines.append(f"MFU: the requests' FLOPs over the run's wall time and the {peaks['matmul_gflops']:.0f} GFLOP/s "
                     f"({peaks['dtype']} GEMM) measured at the start")  # fmt: skip
    return "\n".join(lines)


def write_report(report: StructuredReport, output_dir: Path) -> tuple[Path, Path]:
    json_path, png_path = result_paths(output_dir, "structured", report.model, report.date_utc)
    write_json(json_path, report.to_dict())
    _plot(report, png_path)
    return json_path, png_path


def _plot(report: StructuredReport, path: Path) -> None:
    title = (f"{Path(report.model).name} {report.dtype}, {report.config['num_prompts']} JSON-schema requests\n"
             f"{report.machine['cpu']} ({report.machine['cores']} cores)")  # fmt: skip
    with figure(path, 2, (9, 3.8), title) as (_, (left, right)):
        _plot_panels(report, left, right)


def _plot_panels(report: StructuredReport, left: Any, right: Any) -> None:
    engines = [r.engine for r in report.results]
    x = range(len(engines))
    width = 0.38
    bound = left.bar([i - width / 2 for i in x], [r.constrained.output_tokens_per_s for r in report.results], width,
                     label="json_schema", color=FOLIO_COLOR)  # fmt: skip
    free = left.bar([i + width / 2 for i in x], [r.unconstrained.output_tokens_per_s for r in report.results], width,
                    label="unconstrained", color="#8aa9cf")  # fmt: skip
    left.bar_label(bound, fmt="%.1f", fontsize=8)
    left.bar_label(free, fmt="%.1f", fontsize=8)
    left.set_xticks(list(x), [f"{r.engine}\n{r.throughput_ratio:.2f}x" for r in report.results])
    left.set_ylabel("output tokens/s")
    left.set_title("same prompts, seeds and token counts", fontsize=9)
    left.legend(fontsize=8, loc="lower center")
    left.margins(y=0.15)
    c = report.results[0].constrained
    step_ms = 1000 * c.elapsed_s / max(c.num_steps_masked, 1)
    right.bar(["folio step"], [step_ms - c.mask_ms_per_step], color="#8aa9cf", label="model + sampling")
    right.bar(["folio step"], [c.mask_ms_per_step], bottom=[step_ms - c.mask_ms_per_step], color=PEER_COLOR,
              label="token masks")  # fmt: skip
    right.set_ylabel("ms per constrained step")
    right.set_title(f"masks: {c.mask_ms_per_step:.2f} ms/step, {c.mask_ms_per_row:.3f} ms/row", fontsize=9)
    right.legend(fontsize=8)


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "structured",
        help="the cost of structured output: JSON-schema requests vs the same requests unconstrained",
        description="Run chat requests asking for JSON under a JSON schema (llguidance token masks), then the "
        "same requests unconstrained with EOS ignored, each decoding exactly as many tokens as its constrained "
        "run, and report both throughputs, their ratio, the time spent computing masks per step, and how many "
        "outputs validate against their schema.",
    )
    parser.add_argument("model", help="catalog name, .gguf file or Hugging Face model folder")
    parser.add_argument("--num-prompts", type=int, default=32, help="number of requests (default 32)")
    parser.add_argument("--max-tokens", type=int, default=256, help="output limit per request (default 256)")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    parser.add_argument("--seed", type=int, default=0, help="request i samples with seed + i (default 0)")
    parser.add_argument("--peer", default=None, help="also run the requests on llama.cpp's llama-server: llama.cpp")
    add_output_dir(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(bench_run=run_structured_command)


def run_structured_command(args: argparse.Namespace) -> int:
    config = StructuredConfig(args.model, args.num_prompts, args.max_tokens, args.temperature, args.seed,
                              args.peer, EngineArgs.from_cli_args(args).llm_kwargs())  # fmt: skip
    report = run_structured(config, command_line(args))
    print(f"{report.model} ({report.dtype}), {config.num_prompts} JSON-schema requests, seed {config.seed}")
    print(format_table(report))
    json_path, png_path = write_report(report, Path(args.output_dir))
    print(f"wrote {json_path}")
    print(f"wrote {png_path}")
    return 0
