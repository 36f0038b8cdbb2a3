"""The `folio` parser: every subcommand's flags (engine flags from `EngineArgs`), the tools' subcommands
from their entry point (or a stand-in saying how to install them), and `parse`."""

from __future__ import annotations

import argparse
import os
from importlib.metadata import entry_points
from pathlib import Path

from folio import __version__
from folio.engine_args import DEFAULT_MODEL, EngineArgs, add_parallel_args
from folio.reasoning import REASONING_CHOICES
from folio.scale_out.routing import POLICIES, RoutingConfig
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
    ray.add_argument("--downscale-delay", type=float, default=60.0, help="seconds the load must stay below the "
                     "target before the autoscaler removes a replica (default 60)")  # fmt: skip
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


# Each request-limit flag (but the priority ones): the RequestLimits field it sets, and its help.
LIMIT_FLAGS = {
    "--max-request-bytes": ("max_body_bytes", "largest HTTP request body"),
    "--max-stop-strings": ("max_stop_strings", "stop strings per request"),
    "--max-stop-length": ("max_stop_chars", "characters in one stop string"),
    "--max-logit-bias": ("max_logit_bias", "logit_bias entries per request"),
    "--max-grammar-bytes": ("max_grammar_bytes", "size of a structured-output schema, regex, grammar or choice "
                            "list, as JSON"),
    "--max-logprobs-per-request": ("max_logprobs", "choices x (top_logprobs + 1) x max_tokens a request may ask for"),
    "--max-request-inputs": ("max_inputs", "prompts in one completion request, inputs in one embedding request"),
    "--max-request-tokens": ("max_prompt_tokens", "prompt tokens of one request, all its prompts together"),
}  # fmt: skip


def _add_limit_args(parser: argparse.ArgumentParser) -> None:
    """What one request may cost (folio/server/limits.py); beyond a limit the server answers 400 (413 for
    the body)."""
    defaults = RequestLimits()
    limits = parser.add_argument_group("request limits")
    for flag, (name, help) in LIMIT_FLAGS.items():
        default = getattr(defaults, name)
        limits.add_argument(flag, type=int, default=default, help=f"{help} (default {default})")
    limits.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                        help="fcfs (default): first come, first served, and a request's priority must be 0; "
                        "priority: requests' own priorities order the queue (lower first), as vLLM's")  # fmt: skip
    limits.add_argument("--priority-range", default=None, metavar="LOW:HIGH",
                        help="with --scheduling-policy priority: the priorities a request may ask for "
                        "(default: any 64-bit integer)")  # fmt: skip


# The tools' commands (tools/folio_tools/cli.py registers them), named here so that each one answers
# with the way to install them where they are missing.
TOOL_COMMANDS = {
    "kv-calc": "KV cache and weight memory of a model",
    "quantize": "write a quantized checkpoint",
    "eval": "measure a model's quality",
    "bench": "measure folio's speed, side by side with a peer engine",
}
TOOLS_INSTALL = "pip install -e ./tools (from a folio checkout; the README's test command does it)"


class ToolsMissing(RuntimeError):
    pass


def _add_tool_parsers(sub: argparse._SubParsersAction) -> None:
    """The tools' subcommands, from every `folio.tools` entry point; a stand-in for each one missing."""
    trouble = "not installed"
    for entry in entry_points(group="folio.tools"):
        try:
            entry.load()(sub)
        except ImportError as exc:  # the distribution is listed but its package cannot be imported here
            trouble = f"not importable ({type(exc).__name__}: {exc})"

    def missing(args: argparse.Namespace) -> int:
        raise ToolsMissing(f"`folio {args.command}` is one of folio's tools, {trouble}: {TOOLS_INSTALL}")

    for name, summary in TOOL_COMMANDS.items():
        if name not in sub.choices:
            stand_in = sub.add_parser(name, help=f"{summary} (needs folio's tools)", add_help=False)
            stand_in.set_defaults(tool_run=missing, tools_missing=True)


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
    serve.add_argument("models", nargs="*", metavar="MODEL", help="one model (held for the server's life), or "
                       "several (NAME=PATH names one), loaded when a request names them; none: every pulled "
                       "model")  # fmt: skip
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key", default=os.environ.get("FOLIO_API_KEY"), help="require 'Authorization: Bearer KEY' "
        "on every route but /health (default: $FOLIO_API_KEY)"
    )  # fmt: skip
    serve.add_argument("--no-ui", dest="ui", action="store_false", help="serve no web pages: no playground at "
                       "/ and no dashboard at /dashboard")  # fmt: skip
    serve.add_argument("--max-queue", type=int, default=256, help="requests waiting beyond --max-num-seqs "
                       "before the server answers 429 (default 256)")  # fmt: skip
    serve.add_argument("--grace-period", type=float, default=30.0, help="seconds in-flight requests may take "
                       "to finish after SIGTERM (default 30; fractions allowed)")  # fmt: skip
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=False,
                       help="run the engine in a process of its own, apart from the HTTP server's Python "
                       "(default: a thread of the server's process)")  # fmt: skip
    many = serve.add_argument_group("many models (several MODELs, --models-dir, or none)")
    many.add_argument("--models-dir", type=Path, default=None, help="serve every .gguf file and model folder in "
                      "this folder (looked at again for each unknown name)")  # fmt: skip
    many.add_argument("--max-loaded-models", type=int, default=3, help="models loaded at once; the least "
                      "recently used idle one is unloaded to load another (default 3)")  # fmt: skip
    many.add_argument("--models-memory", default=None, help="memory the loaded models' weights and KV caches "
                      "may hold together, e.g. 12GiB; to load another, idle ones are unloaded (default: 80%% of "
                      "the memory free at start)")  # fmt: skip
    many.add_argument("--no-spare-engine", dest="spare_engine", action="store_false", help="start each model's "
                      "engine process when it loads, not ahead (an idle spare process holds a few hundred MiB; "
                      "it saves the seconds of importing torch on each load)")  # fmt: skip
    many.add_argument("--keep-alive", default=os.environ.get("FOLIO_KEEP_ALIVE", "5m"), help="how long an idle "
                      "model stays loaded: a duration (5m, 1h30m) or seconds; 0 unloads at once, negative never "
                      "(default 5m or $FOLIO_KEEP_ALIVE; a request's keep_alive overrides it)")  # fmt: skip
    lora = serve.add_argument_group("LoRA adapters")
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH", help="PEFT adapter folders "
                      "served beside their base model; a request names one as its model. Among several models, "
                      "give vLLM's JSON form: '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' "
                      "(implies --enable-lora for that model)")  # fmt: skip
    lora.add_argument("--runtime-lora", action="store_true", help="allow /v1/load_lora_adapter and "
                      "/v1/unload_lora_adapter (they read adapter folders that requests name on this "
                      "machine)")  # fmt: skip
    _add_chat_parser_args(serve)
    _add_limit_args(serve)
    _add_replica_args(serve)
    EngineArgs.add_cli_args(serve)

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

    worker = sub.add_parser("worker", help="start this host's ranks of a model split over several hosts")
    add_parallel_args(worker, engine=False)
    worker.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present, else cpu)")

    _add_tool_parsers(sub)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line. argparse takes a subcommand's positionals in one go, so `folio run MODEL --raw
    PROMPT` would read MODEL as the prompt; a subcommand without subcommands of its own reads its
    positionals intermixed with its flags instead."""
    parser = build_parser()
    command = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    stand_in = command.choices.get(argv[0]) if command is not None and argv else None
    if stand_in is not None and stand_in.get_default("tools_missing"):
        return argparse.Namespace(command=argv[0], tool_run=stand_in.get_default("tool_run"))  # whatever follows
    args, extras = parser.parse_known_args(argv)
    sub = command.choices.get(args.command) if command is not None else None
    nested = sub is not None and any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)
    if not extras or sub is None or nested:
        return parser.parse_args(argv)  # the usual errors for what is left over
    intermixed = sub.parse_intermixed_args(argv[argv.index(args.command) + 1 :])
    return argparse.Namespace(**{**vars(args), **vars(intermixed)})
