"""`folio bench parallel`: one model run whole and split over ranks, side by side in one run, on the
same cores.

Each `--engines` entry is an engine: tp1 in process with a thread per core; tpN as N tensor-parallel
ranks, each pinned to its share of the cores, exchanging through shared memory (tpN-gloo: through
gloo over loopback TCP, the transport between hosts); ppM as M pipeline stages (hidden states sent
with gloo); tpNxppM both, N x M ranks; cpN as N context-parallel ranks (cpN-gloo likewise). All are
loaded at once (idle ranks wait without spinning) and measured in turn, round after round, so the
machine's drift hits each alike:
- batch 1: one request's decode rate (tokens after the first over the time after the first);
- batch N (`--batch`): N distinct prompts at once, output tok/s over the wall time, prefill included
  (prefix caching is off, so each round prefills the same prompts again);
- a long prompt (`--long-prompt-tokens`, 0 to skip): one prompt's prefill, prompt tokens per second
  to its first token (what context parallelism divides);
- for split engines, rank 0's time per step in collectives (all-reduces and the logits' all-gather)
  and in waiting on its sends to the next stage, with the bytes it moved, and its share of the step.
Ratios are against the whole model's figure of the same round. MBU of batch 1, MFU of batch N and of the
long prefill are against the machine's peaks measured as the run starts (roofline.py): every engine
runs on the same cores, and a split one's ranks together read and multiply the whole model.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from folio.engine.llm import LLM
from folio.engine_args import EngineArgs
from folio.platform import default_device, resolve_dtype
from folio.sampling_params import SamplingParams
from folio.worker.executor import SplitModelExecutor
from folio_tools.bench.harness.flags import add_output_dir, command_line
from folio_tools.bench.harness.roofline import MachinePeaks, TokenCost, mean_decode_context, measure_peaks
from folio_tools.bench.parallel.report import format_table, write_plot
from folio_tools.results import machine_info, result_paths, write_json

TEXT = (
    "The committee reviewed the quarterly figures, asked for the missing receipts, and agreed to meet again "
    "after the audit. Several members noted that the travel budget had grown faster than planned, while the "
    "maintenance line stayed flat. "
)


@dataclass
class Measure:
    batch1_decode_tok_s: list[float] = field(default_factory=list)
    batch_output_tok_s: list[float] = field(default_factory=list)
    comm_ms_per_step_batch1: list[float] = field(default_factory=list)
    comm_ms_per_step_batch: list[float] = field(default_factory=list)
    comm_kib_per_step_batch1: list[float] = field(default_factory=list)
    comm_kib_per_step_batch: list[float] = field(default_factory=list)
    step_ms_batch1: list[float] = field(default_factory=list)
    step_ms_batch: list[float] = field(default_factory=list)
    long_prefill_tok_s: list[float] = field(default_factory=list)
    comm_ms_per_step_long: list[float] = field(default_factory=list)
    comm_kib_per_step_long: list[float] = field(default_factory=list)


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser("parallel", help="tensor and pipeline parallelism: whole vs split, same cores")
    parser.add_argument("model", nargs="?", default="gemma3-270m")
    parser.add_argument("--engines", nargs="+", default=["tp1", "tp2", "pp2", "cp2"],
                        help="tp1, tpN (shared memory), tpN-gloo, ppM, tpNxppM, cpN, cpN-gloo (default: tp1 tp2 "
                        "pp2 cp2)")  # fmt: skip
    parser.add_argument("--batch", type=int, default=64, help="concurrent requests of the batched run (64)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt (128)")
    parser.add_argument("--batch1-tokens", type=int, default=128, help="tokens generated at batch 1 (128)")
    parser.add_argument("--batch-tokens", type=int, default=32, help="tokens generated per batched request (32)")
    parser.add_argument("--long-prompt-tokens", type=int, default=4096,
                        help="tokens of the long prompt whose prefill is timed (4096; 0: none)")  # fmt: skip
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024,
                        help="token budget per step: the long prompt's chunk (1024)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each measuring every engine (3)")
    parser.add_argument("--dtype", default="float32", help="activations: float32 or bfloat16")
    parser.add_argument("--quantization", default=None, help="as `folio serve --quantization` (default: as stored)")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="KV pool over all ranks (1GiB)")
    parser.add_argument("--micro-batches", type=int, default=None,
                        help="pieces a pipeline splits each step into (default: 2 per stage)")  # fmt: skip
    parser.add_argument("--pipeline-layers", default=None,
                        help="layers per stage of pipelined engines, e.g. 9,9 (default: by weight)")  # fmt: skip
    add_output_dir(parser)
    parser.set_defaults(bench_run=run)


@dataclass(frozen=True)
class Split:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    cpu_collectives: str = "shm"
    context_parallel_size: int = 1


def parse_engine(name: str) -> Split:
    """ "tp2" -> Split(2, 1, "shm"), "tp2-gloo" -> Split(2, 1, "gloo"), "tp2xpp2" -> Split(2, 2, "shm"),
    "cp2" -> Split(1, 1, "shm", 2)."""
    sizes, _, transport = name.partition("-")
    found: dict[str, int] = {}
    for part in sizes.split("x"):
        kind, size = part[:2], part[2:]
        if kind not in ("tp", "pp", "cp") or kind in found or not size.isdigit() or int(size) < 1:
            break
        found[kind] = int(size)
    else:
        if transport in ("", "gloo") and not ("cp" in found and len(found) > 1):
            return Split(found.get("tp", 1), found.get("pp", 1), transport or "shm", found.get("cp", 1))
    raise ValueError(f"--engines: {name!r} is not tp1, tpN, tpN-gloo, ppM, tpNxppM, cpN or cpN-gloo")


def _prompts(llm: LLM, count: int, length: int) -> list[list[int]]:
    """Distinct prompts (their first block differs, so no prefix is shared) of `length` tokens."""
    body = llm.tokenizer.encode(TEXT * (1 + length // 20))
    return [(llm.tokenizer.encode(f"Record {i}:") + body)[:length] for i in range(count)]


def _long_prompt(llm: LLM, length: int) -> list[int]:
    """A prompt of `length` tokens whose text does not repeat (numbered records)."""
    ids: list[int] = []
    record = 0
    while len(ids) < length:
        ids += llm.tokenizer.encode(f"Record {record}: {TEXT}")
        record += 1
    return ids[:length]


@dataclass(frozen=True)
class Timed:
    wall: float
    outputs: list[Any]
    comm_ms_per_step: float
    comm_kib_per_step: float
    step_ms: float


def _comm(llm: LLM) -> tuple[float, int, int]:
    """(rank 0's seconds communicating, bytes it moved, steps that ran the model) so far."""
    runner = llm.engine.runner
    stats = runner.comm_stats() if isinstance(runner, SplitModelExecutor) else None
    return (stats.seconds, stats.bytes, llm.engine.num_steps) if stats else (0.0, 0, llm.engine.num_steps)


def _timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> Timed:
    seconds0, bytes0, steps0 = _comm(llm)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    seconds1, bytes1, steps1 = _comm(llm)
    steps = max(steps1 - steps0, 1)
    return Timed(wall, outputs, (seconds1 - seconds0) * 1000 / steps, (bytes1 - bytes0) / 1024 / steps,
                 wall * 1000 / steps)  # fmt: skip


def _round(llm: LLM, measure: Measure, args: argparse.Namespace, prompts: list[list[int]],
           long_prompt: list[int]) -> None:  # fmt: skip
    one = _timed(llm, prompts[:1], args.batch1_tokens)
    metrics = one.outputs[0].metrics
    decode_seconds = metrics.finish_time - metrics.first_token_time
    measure.batch1_decode_tok_s.append((args.batch1_tokens - 1) / decode_seconds)
    measure.comm_ms_per_step_batch1.append(one.comm_ms_per_step)
    measure.comm_kib_per_step_batch1.append(one.comm_kib_per_step)
    measure.step_ms_batch1.append(one.step_ms)
    many = _timed(llm, prompts, args.batch_tokens)
    measure.batch_output_tok_s.append(sum(len(o.outputs[0].token_ids) for o in many.outputs) / many.wall)
    measure.comm_ms_per_step_batch.append(many.comm_ms_per_step)
    measure.comm_kib_per_step_batch.append(many.comm_kib_per_step)
    measure.step_ms_batch.append(many.step_ms)
    if long_prompt:
        long = _timed(llm, [long_prompt], 1)
        measure.long_prefill_tok_s.append(len(long_prompt) / long.wall)
        measure.comm_ms_per_step_long.append(long.comm_ms_per_step)
        measure.comm_kib_per_step_long.append(long.comm_kib_per_step)


def run(args: argparse.Namespace) -> int:
    engines = {name: parse_engine(name) for name in args.engines}
    if engines.get("tp1") != Split():
        raise ValueError("--engines must include tp1: every ratio is against the whole model")
    date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    peaks = measure_peaks(resolve_dtype(args.dtype, default_device())[0])  # before any model takes memory or cores
    llms: dict[str, LLM] = {}
    for name, split in engines.items():
        engine = EngineArgs(args.model, dtype=args.dtype, quantization=args.quantization,
                            kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(args.batch, 1),
                            enable_prefix_caching=False,  # every round prefills its prompts anew
                            tensor_parallel_size=split.tensor_parallel_size,
                            pipeline_parallel_size=split.pipeline_parallel_size,
                            context_parallel_size=split.context_parallel_size,
                            max_num_batched_tokens=args.max_num_batched_tokens,
                            pipeline_micro_batches=args.micro_batches,
                            pipeline_layers=args.pipeline_layers if split.pipeline_parallel_size > 1 else None,
                            cpu_collectives=split.cpu_collectives)  # fmt: skip
        llms[name] = LLM.from_engine_args(engine)
    first = next(iter(llms.values()))
    whole = llms["tp1"]
    cost = TokenCost.of(whole.loaded.path, whole.loaded.step_weight_bytes(), whole.engine.kv_bytes_per_token)
    prompts = _prompts(first, args.batch, args.prompt_tokens)
    long_prompt = _long_prompt(first, args.long_prompt_tokens) if args.long_prompt_tokens else []
    measures = {name: Measure() for name in llms}
    for llm in llms.values():  # warm-up: kernels built, pages touched
        llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    try:
        for index in range(args.rounds):
            for name, llm in llms.items():
                _round(llm, measures[name], args, prompts, long_prompt)
                done = measures[name]
                long = (
                    f", {len(long_prompt)}-token prefill {done.long_prefill_tok_s[-1]:.1f} tok/s" if long_prompt else ""
                )
                print(f"round {index + 1}/{args.rounds} {name}: batch 1 {done.batch1_decode_tok_s[-1]:.1f} tok/s, "
                      f"batch {args.batch} {done.batch_output_tok_s[-1]:.1f} tok/s{long}", flush=True)  # fmt: skip
    finally:
        for llm in llms.values():
            llm.close()
    report = _report(args, date, measures, cost, peaks)
    json_path, png_path = result_paths(Path(args.output_dir), "parallel", args.model, date)
    write_json(json_path, report)
    write_plot(png_path, report)
    print(format_table(report))
    print(f"wrote {json_path} and {png_path}")
    return 0


def _utilisation(args: argparse.Namespace, summary: dict[str, Any], cost: TokenCost,
                 peaks: MachinePeaks) -> dict[str, float | None]:  # fmt: skip
    """MBU of the batch-1 rate, MFU of the batch-N rate and of the long prefill, from an engine's medians."""
    batch1_context = mean_decode_context(args.prompt_tokens, args.batch1_tokens)
    batch1 = cost.utilisation(summary["batch1_decode_tok_s"], 1, batch1_context, peaks)
    many_context = mean_decode_context(args.prompt_tokens, args.batch_tokens)
    many = cost.utilisation(summary["batch_output_tok_s"], args.batch, many_context, peaks)
    long = summary["long_prefill_tok_s"]
    return {"batch1_mbu": batch1["mbu"], "batch_mfu": many["mfu"],
            "long_prefill_mfu": cost.prefill_mfu(args.long_prompt_tokens, long, peaks) if long else None}  # fmt: skip


def _report(args: argparse.Namespace, date: str, measures: dict[str, Measure], cost: TokenCost,
            peaks: MachinePeaks) -> dict[str, Any]:  # fmt: skip
    base = measures["tp1"]
    engines = {}
    for name, m in measures.items():
        ratios1 = [a / b for a, b in zip(m.batch1_decode_tok_s, base.batch1_decode_tok_s, strict=True)]
        ratios = [a / b for a, b in zip(m.batch_output_tok_s, base.batch_output_tok_s, strict=True)]
        ratios_long = [a / b for a, b in zip(m.long_prefill_tok_s, base.long_prefill_tok_s, strict=True)]
        summary = {key: statistics.median(values) if values else None for key, values in asdict(m).items()}
        summary |= {"batch1_ratio": statistics.median(ratios1), "batch_ratio": statistics.median(ratios),
                    "long_prefill_ratio": statistics.median(ratios_long) if ratios_long else None}  # fmt: skip
        summary |= _utilisation(args, summary, cost, peaks)
        engines[name] = {"median": summary, "rounds": asdict(m)}
    return {"benchmark": "parallel", "date_utc": date, "command": command_line(args), "model": args.model,
            "batch": args.batch, "long_prompt_tokens": args.long_prompt_tokens,
            "max_num_batched_tokens": args.max_num_batched_tokens, "micro_batches": args.micro_batches,
            "pipeline_layers": args.pipeline_layers, "machine": machine_info(), "peaks": peaks.to_dict(),
            "engines": engines}  # fmt: skip
