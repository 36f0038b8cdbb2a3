"""`folio bench decode`: decode speed of a model's weight formats, and a peer's on the same weights.

For each folio variant (a GGUF file's weights kept quantized, and dequantized to --dtype; a model
folder's weights as stored) it loads the model and measures
- batch-1 decode: one request decoding `--gen-tokens` tokens after a short prompt, timed from its
  first token to its last (prefill excluded), as llama-bench's tg measures; best of `--repeats`;
- batch-64 output throughput: 64 requests decoding `--gen-tokens` each, all submitted at once, best of
  `--repeats` after a short warm-up at that batch;
- prefill: prompt tok/s for prompts of each `--prompt-tokens` length (prefill.py), as llama-bench's pp;
- the weights' resident bytes;
- MBU and MFU of these rates against the peaks of the device it runs on, measured as the run starts
  (roofline.py).
With `--peer llama.cpp`, llama-bench runs `-p <prompt-tokens> -n <gen-tokens>` (pp and tg), and
llama-batched-bench decodes `--gen-tokens` after 16-token prompts at 1 to `--batch` parallel sequences
(its aggregate rate at each, the best reported as its batched rate), with the same thread count on the
same file, after folio has released its memory. With `--peer hf`, transformers measures the same three
rates on the same weights, device and dtype (hf_decode_peer.py): the peer where llama.cpp cannot run,
as on a GPU here.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import torch

from folio import LLM, SamplingParams
from folio.engine_args import EngineArgs
from folio.loaders.catalog import resolve_model
from folio.platform import default_device, default_threads, resolve_dtype
from folio_tools.bench.harness.flags import add_output_dir, command_line
from folio_tools.bench.harness.paired_rounds import alternate
from folio_tools.bench.harness.plots import engine_bars, engine_colors, figure
from folio_tools.bench.harness.prefill import DEFAULT_LENGTHS, measure_prefill, random_prompt
from folio_tools.bench.harness.roofline import MachinePeaks, TokenCost, mean_decode_context, measure_peaks
from folio_tools.bench.harness.table import percent, row
from folio_tools.bench.peers.hf_decode import hf_decode_rates
from folio_tools.bench.peers.llama_cpp_build import build_llama_cpp
from folio_tools.kv_calc import load_shape
from folio_tools.results import machine_info, result_paths, write_json

VARIANTS = {"gguf": None, "dequantized": "none"}  # name -> LLM(quantization=...)
PEERS = (None, "llama.cpp", "hf")
PROMPT = "Write a long story about a lighthouse keeper."


@dataclass
class DecodeConfig:
    model: str
    gen_tokens: int = 128
    batch: int = 64
    repeats: int = 3
    peer: str | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: tuple[int, ...] = DEFAULT_LENGTHS
    paired_rounds: int = 5  # with llama.cpp: batch-1 rounds alternating with llama-bench's tg (0: none)


@dataclass
class VariantResult:
    engine: str  # "folio gguf", "folio dequantized", "llama.cpp"
    weight_mib: float | None  # resident, as folio counts it; None for the peer (not measured)
    batch1_tok_s: float
    batch_tok_s: float | None  # None for the peer (llama-bench has no batched decode)
    # Fractions of the machine's measured peaks (folio_tools/bench/harness/roofline.py); the peer's use the file's
    # bytes as its resident weights.
    batch1_mbu: float | None = None
    batch1_mfu: float | None = None
    batch_mbu: float | None = None
    batch_mfu: float | None = None
    # Prompt length (as a string: JSON keys) -> prompt tok/s, and its MFU.
    prefill_tok_s: dict[str, float] = field(default_factory=dict)
    prefill_mfu: dict[str, float] = field(default_factory=dict)

    def add_utilisation(self, cost: TokenCost, peaks: MachinePeaks, prompt_tokens: int, gen_tokens: int,
                        batch: int) -> None:  # fmt: skip
        context = mean_decode_context(prompt_tokens, gen_tokens)
        one = cost.utilisation(self.batch1_tok_s, 1, context, peaks)
        self.batch1_mbu, self.batch1_mfu = one["mbu"], one["mfu"]
        if self.batch_tok_s is not None:
            many = cost.utilisation(self.batch_tok_s, batch, context, peaks)
            self.batch_mbu, self.batch_mfu = many["mbu"], many["mfu"]
        self.prefill_mfu = {n: cost.prefill_mfu(int(n), rate, peaks) for n, rate in self.prefill_tok_s.items()}


@dataclass
class DecodeReport:
    command: str
    date_utc: str
    model: str
    dtype: str
    config: dict[str, Any]
    results: list[VariantResult]
    peer_info: dict[str, Any] = field(default_factory=dict)
    peaks: dict[str, Any] = field(default_factory=dict)  # MachinePeaks, measured as the run started
    machine: dict[str, Any] = field(default_factory=machine_info)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "results": [asdict(r) for r in self.results]}


def measure_batch1(llm: Any, gen_tokens: int, repeats: int) -> float:
    params = SamplingParams(max_tokens=gen_tokens, temperature=0, ignore_eos=True)
    best = 0.0
    for _ in range(repeats):
        [out] = llm.generate(PROMPT, params, use_tqdm=False)
        decode_s = out.metrics.finish_time - out.metrics.first_token_time
        best = max(best, (gen_tokens - 1) / decode_s)
    return best


WARM_UP_TOKENS = 8  # a short batched run first: the first steps of a new batch size run cold (~15% slower)


def measure_batched(llm: Any, gen_tokens: int, batch: int, repeats: int = 1) -> float:
    """Output tok/s of `batch` requests decoding `gen_tokens` each, prefill included: the best of `repeats`
    runs after a short warm-up at the same batch size (llama-batched-bench warms up too)."""
    prompts = [f"{PROMPT} Chapter {i + 1}." for i in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=WARM_UP_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(max_tokens=gen_tokens, temperature=0, ignore_eos=True)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        best = max(best, sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    return best


def _llama_bench(path: Path, gen_tokens: int, prompt_tokens: tuple[int, ...], repeats: int,
                 threads: int) -> tuple[float, dict[str, float], dict[str, Any]]:  # fmt: skip
    """llama-bench's tg tok/s, its pp tok/s per prompt length, and how it ran."""
    binaries = build_llama_cpp()
    prompts = ",".join(str(n) for n in prompt_tokens) or "0"
    cmd = [str(binaries.bench), "-m", str(path), "-p", prompts, "-n", str(gen_tokens), "-t", str(threads),
           "-r", str(repeats), "-o", "json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800)
    records = json.loads(out.stdout)
    [tg] = [r for r in records if r.get("n_gen") == gen_tokens and not r.get("n_prompt")]
    pp = {str(r["n_prompt"]): float(r["avg_ts"]) for r in records if r.get("n_prompt") and not r.get("n_gen")}
    info = {"llama_cpp_version": binaries.version, "llama_cpp_commit": binaries.commit, "command": " ".join(cmd),
            "stddev_ts": tg.get("stddev_ts")}  # fmt: skip
    return float(tg["avg_ts"]), pp, info


def _llama_tg(path: Path, gen_tokens: int, threads: int) -> float:
    """One llama-bench tg run's tok/s (after its own warm-up run)."""
    return _llama_bench(path, gen_tokens, (), 1, threads)[0]


BATCHED_PROMPT_TOKENS = 16  # llama-batched-bench's prompts: folio's batched run's are about as long


def _llama_batched_bench(path: Path, gen_tokens: int, batch: int, threads: int) -> dict[str, float]:
    """llama-batched-bench's aggregate decode tok/s (S_TG) at each parallel-sequence count up to `batch`."""
    binaries = build_llama_cpp()
    counts = sorted({n for n in (1, 2, 4, 8, 16, 32, 64) if n < batch} | {batch})
    context = batch * (BATCHED_PROMPT_TOKENS + gen_tokens)
    cmd = [str(binaries.batched_bench), "-m", str(path), "-c", str(context), "-b", "2048", "-ub", "512", "-kvu",
           "-npp", str(BATCHED_PROMPT_TOKENS), "-ntg", str(gen_tokens), "-npl", ",".join(map(str, counts)),
           "-t", str(threads), "--output-format", "jsonl"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=3600)
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {str(r["pl"]): float(r["speed_tg"]) for r in records}


def run_decode(config: DecodeConfig, command: str) -> DecodeReport:
    if config.peer not in PEERS:
        raise ValueError(f"unknown peer {config.peer!r}; choose llama.cpp or hf")
    date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    path = resolve_model(config.model)
    if path.suffix != ".gguf" and config.peer == "llama.cpp":
        raise ValueError(f"llama.cpp reads GGUF files, and {config.model} is {path}")
    variants = VARIANTS if path.suffix == ".gguf" else {"checkpoint": None}  # a folder: its weights as stored
    threads = default_threads()
    torch.set_num_threads(threads)
    device = torch.device(config.engine_args.get("device") or default_device())
    peaks = measure_peaks(resolve_dtype(config.engine_args.get("dtype") or "float32", device)[0], device=device)
    results = []
    dtype = "float32"
    peer_prompts: tuple[list[int], dict[int, list[int]]] = ([], {})
    cost: TokenCost | None = None
    paired_batch1: dict[str, Any] = {}
    for name, quantization in variants.items():
        llm = LLM(path, quantization=quantization, **config.engine_args)
        torch.set_num_threads(threads)
        dtype = str(llm.dtype).removeprefix("torch.")
        measure_batch1(llm, 8, 1)  # warm-up: kernels built and loaded, first-call allocations
        batch1 = measure_batch1(llm, config.gen_tokens, config.repeats)
        batched = measure_batched(llm, config.gen_tokens, config.batch, config.repeats)
        result = VariantResult(f"folio {name}", llm.loaded.weight_bytes / 2**20, batch1, batched)
        if config.peer == "llama.cpp" and config.paired_rounds and not results:  # the kept weights
            paired = alternate(
                partial(measure_batch1, llm, config.gen_tokens, 1),
                partial(_llama_tg, path, config.gen_tokens, threads),
                config.paired_rounds,
            )
            paired_batch1 = {"folio": name, **paired.to_dict()}
        result.prefill_tok_s = {str(n): measure_prefill(llm, n, config.repeats) for n in config.prompt_tokens}
        prompt_tokens = len(llm.tokenizer.encode(PROMPT))
        cost = TokenCost.of(path, llm.loaded.step_weight_bytes(), llm.engine.kv_bytes_per_token)
        result.add_utilisation(cost, peaks, prompt_tokens, config.gen_tokens, config.batch)
        results.append(result)
        peer_prompts = (llm.tokenizer.encode(PROMPT), {n: random_prompt(llm, n, seed=7) for n in config.prompt_tokens})
        del llm
        gc.collect()
    if config.peer == "hf":  # the same weights, dtype and device through transformers
        dtype_of_run = resolve_dtype(config.engine_args.get("dtype") or "float32", device)[0]
        one, many, prefill = hf_decode_rates(path, dtype_of_run, device, peer_prompts[0], config.gen_tokens,
                                             config.batch, peer_prompts[1], config.repeats)  # fmt: skip
        peer = VariantResult("transformers", None, one, many, prefill_tok_s=prefill)
        assert cost is not None
        peer.add_utilisation(cost, peaks, len(peer_prompts[0]), config.gen_tokens, config.batch)
        results.append(peer)
    peer_info: dict[str, Any] = {}
    if config.peer == "llama.cpp":
        tok_s, pp, peer_info = _llama_bench(path, config.gen_tokens, config.prompt_tokens, config.repeats, threads)
        batched = _llama_batched_bench(path, config.gen_tokens, config.batch, threads)
        peer_info["batched_tok_s"] = batched  # by parallel sequences; the best is its batched rate
        if paired_batch1:
            peer_info["paired_batch1"] = paired_batch1  # first: folio's rates, second: llama-bench's tg
        peer = VariantResult("llama.cpp", None, tok_s, max(batched.values(), default=None), prefill_tok_s=pp)
        # llama-bench's tg runs after an empty prompt (-p 0), holds the file's weights as they are and its
        # KV cache in float16.
        shape = load_shape(path).config
        f16_kv = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2
        best_batch = int(max(batched, key=lambda n: batched[n])) if batched else 1
        peer.add_utilisation(TokenCost.of(path, path.stat().st_size, f16_kv), peaks, 0, config.gen_tokens, 1)
        if peer.batch_tok_s is not None:  # at the parallel-sequence count that gave its best rate
            best = TokenCost.of(path, path.stat().st_size, f16_kv).utilisation(
                peer.batch_tok_s, best_batch, mean_decode_context(BATCHED_PROMPT_TOKENS, config.gen_tokens), peaks
            )
            peer.batch_mbu, peer.batch_mfu = best["mbu"], best["mfu"]
        results.append(peer)
    settings = {k: v for k, v in asdict(config).items() if k != "model"}
    return DecodeReport(command, date, config.model, dtype, settings, results, peer_info, peaks.to_dict())


def format_table(report: DecodeReport) -> str:
    batch = report.config["batch"]
    lengths = [str(n) for n in report.config.get("prompt_tokens", ())]
    widths = [12, 15, 11, 17, 11] + [16] * len(lengths)
    labels = ["weights MiB", "batch-1 tok/s", "MBU", f"batch-{batch} tok/s", "MFU"] + [f"pp{n} (MFU)" for n in lengths]
    lines = [row("engine", labels, widths=widths)]
    for r in report.results:
        values = [r.weight_mib, r.batch1_tok_s, percent(r.batch1_mbu, "%"), r.batch_tok_s, percent(r.batch_mfu, "%")]
        values += [_prefill_cell(r, n) for n in lengths]
        lines.append(row(r.engine, values, widths=widths, number=".1f"))
    peaks = report.peaks
    if peaks:
        lines.append(f"peaks measured at the start: {peaks['matmul_gflops']:.0f} GFLOP/s ({peaks['dtype']} GEMM), "
                     f"{peaks['read_gbps']:.1f} GB/s read")  # fmt: skip
    first, peer = report.results[0], report.results[-1]
    if peer.engine == "transformers":
        lines.append(f"batch-1: {first.engine} / transformers = {first.batch1_tok_s / peer.batch1_tok_s:.2f}x")
        if first.batch_tok_s and peer.batch_tok_s:
            lines.append(f"batch-{batch}: {first.engine} / transformers = {first.batch_tok_s / peer.batch_tok_s:.2f}x")
        for n in lengths:
            if peer.prefill_tok_s.get(n) and first.prefill_tok_s.get(n):
                lines.append(f"prefill: {first.engine} / transformers pp{n} = "
                             f"{first.prefill_tok_s[n] / peer.prefill_tok_s[n]:.2f}x")  # fmt: skip
    if peer.engine == "llama.cpp":
        lines.append(f"batch-1: folio gguf / llama.cpp tg{report.config['gen_tokens']} = "
                     f"{first.batch1_tok_s / peer.batch1_tok_s:.2f}x")  # fmt: skip
        paired = report.peer_info.get("paired_batch1")
        if paired:
            ratios = paired["ratios"]
            lines.append(f"batch-1, {len(ratios)} rounds alternating folio {paired['folio']} and llama-bench's "
                         f"tg{report.config['gen_tokens']}: median {paired['median_ratio']:.2f}x "
                         f"(rounds {min(ratios):.2f}-{max(ratios):.2f}x)")  # fmt: skip
        batched = report.peer_info.get("batched_tok_s") or {}
        if batched and peer.batch_tok_s:
            best_n = max(batched, key=lambda n: batched[n])
            folio_best = max(r.batch_tok_s or 0.0 for r in report.results[:-1])
            lines.append(f"batch-{batch}: best folio / llama-batched-bench's best ({best_n} sequences) = "
                         f"{folio_best / peer.batch_tok_s:.2f}x")  # fmt: skip
        for n in lengths:
            best = max(r.prefill_tok_s.get(n, 0.0) for r in report.results[:-1])
            if peer.prefill_tok_s.get(n):
                lines.append(f"prefill: best folio / llama.cpp pp{n} = {best / peer.prefill_tok_s[n]:.2f}x")
    return "\n".join(lines)


def _prefill_cell(result: VariantResult, length: str) -> str | None:
    rate = result.prefill_tok_s.get(length)
    if rate is None:
        return None
    mfu = result.prefill_mfu.get(length)
    return f"{rate:.0f}" + (f" ({percent(mfu, '%')})" if mfu is not None else "")


def write_report(report: DecodeReport, output_dir: Path) -> tuple[Path, Path]:
    json_path, png_path = result_paths(output_dir, "decode", report.model, report.date_utc, report.dtype)
    write_json(json_path, report.to_dict())
    _plot(report, png_path)
    return json_path, png_path


def _plot(report: DecodeReport, path: Path) -> None:
    names = [r.engine for r in report.results]
    colors = engine_colors(names, peer="llama.cpp")
    lengths = [str(n) for n in report.config.get("prompt_tokens", ())]
    panels = [(lambda r: r.batch1_tok_s, "batch-1 decode tok/s"),
              (lambda r: r.batch_tok_s, f"batch-{report.config['batch']} tok/s")]  # fmt: skip
    panels += [(lambda r, n=n: r.prefill_tok_s.get(n), f"pp{n} prompt tok/s") for n in lengths]
    panels.append((lambda r: r.weight_mib, "resident weights MiB"))
    title = (f"{Path(report.model).name} ({report.dtype} activations), {report.machine['cpu']} "
             f"({report.machine['cores']} cores)")  # fmt: skip
    with figure(path, len(panels), (4 * len(panels), 3.8), title) as (_, axes):
        for ax, (value, label) in zip(axes, panels, strict=True):
            engine_bars(ax, names, [value(r) for r in report.results], colors, label, label_size=8)
            ax.tick_params(axis="x", labelsize=7)


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "decode",
        help="decode speed of a GGUF file's weights kept quantized vs dequantized, optionally vs llama-bench",
        description="Load a GGUF model twice (its weights kept quantized, then dequantized to --dtype) and measure "
        "batch-1 decode tok/s (prefill excluded, best of --repeats), batch-N output tok/s, prefill tok/s of each "
        "--prompt-tokens length and resident weight memory; with --peer llama.cpp also llama-bench's tg and pp on "
        "the same file with the same threads.",
    )
    parser.add_argument("model", help="catalog name, .gguf file or Hugging Face model folder (its weights as stored)")
    parser.add_argument("--gen-tokens", type=int, default=128, help="tokens each request decodes (default 128)")
    parser.add_argument("--batch", type=int, default=64, help="requests of the batched run (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="batch-1 and prefill runs, best kept (default 3)")
    parser.add_argument("--prompt-tokens", type=int, nargs="*", default=list(DEFAULT_LENGTHS),
                        help="prompt lengths whose prefill is measured (default 128 512 2048)")  # fmt: skip
    parser.add_argument("--peer", default=None, choices=["llama.cpp", "hf"],
                        help="also run llama-bench on the same file (llama.cpp), or transformers on the same weights, "
                        "device and dtype (hf)")  # fmt: skip
    parser.add_argument("--paired-rounds", type=int, default=5,
                        help="with --peer llama.cpp: rounds alternating one folio batch-1 run and one llama-bench tg "
                        "run, whose median ratio a drifting machine skews less (default 5; 0: none)")  # fmt: skip
    add_output_dir(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(bench_run=run_decode_command)


def run_decode_command(args: argparse.Namespace) -> int:
    engine = EngineArgs.from_cli_args(args).llm_kwargs()
    del engine["quantization"]  # both variants run, each with its own
    if args.paired_rounds < 0:
        raise ValueError(f"--paired-rounds must be 0 or more, got {args.paired_rounds}")
    config = DecodeConfig(args.model, args.gen_tokens, args.batch, args.repeats, args.peer, engine,
                          tuple(args.prompt_tokens), args.paired_rounds)  # fmt: skip
    report = run_decode(config, command_line(args))
    print(f"{report.model} ({report.dtype} activations), batch-1 over {config.gen_tokens} tokens")
    print(format_table(report))
    json_path, png_path = write_report(report, Path(args.output_dir))
    print(f"wrote {json_path}")
    print(f"wrote {png_path}")
    return 0
