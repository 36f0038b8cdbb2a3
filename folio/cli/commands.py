"""What each `folio` subcommand of the runtime does (its flags are parsed in parser.py; main.py dispatches here)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from folio import LLM
from folio.cli.parser import LIMIT_FLAGS
from folio.config import ParallelConfig, parse_memory
from folio.engine.engine_core import EngineCore
from folio.engine_args import DEFAULT_MODEL, EngineArgs
from folio.loaders.catalog import CATALOG, list_pulled, pull
from folio.paths import atomic_open
from folio.platform import available_memory, default_device
from folio.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from folio.scale_out.options import ReplicaOptions
from folio.scale_out.routing import RoutingConfig
from folio.server.adapters import LoRAModule
from folio.server.context import ChatOptions
from folio.server.limits import RequestLimits
from folio.server.model_budget import ManagerOptions
from folio.server.model_sources import ModelSources
from folio.server.openai.batch_file import batch_lines, run_batch
from folio.server.serve import (
    ServerOptions,
    StartupInterrupted,
    bind_address,
    build_server,
    serve,
    serve_models,
    sigterm_stops_startup,
)
from folio.server.served_models import keep_alive_seconds
from folio.structured.params import StructuredOutputParams
from folio.worker.executor import run_worker_host


def _llm(args: argparse.Namespace) -> LLM:
    return LLM.from_engine_args(EngineArgs.from_cli_args(args))


_SAMPLING_FLAGS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed")  # parser.py's _add_sampling_args


def _sampling(args: argparse.Namespace, **overrides: Any) -> SamplingParams:
    given = {**{name: getattr(args, name) for name in _SAMPLING_FLAGS}, **overrides}
    return SamplingParams(**given, structured_output=_output_format(getattr(args, "format", None)))


def _output_format(value: str | None) -> StructuredOutputParams | None:
    """--format: 'json', an inline JSON schema, or the path of a file holding one."""
    if value is None:
        return None
    if value == "json":
        return StructuredOutputParams(json_object=True)
    text = value
    if not value.lstrip().startswith("{"):
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"--format takes 'json', a JSON schema or a schema file; {value!r} is none of them")
        text = path.read_text(encoding="utf-8")
    return StructuredOutputParams(json=text)


def _human_size(num_bytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    return f"{num_bytes} B"


def cmd_pull(args: argparse.Namespace) -> int:
    path = pull(args.model)
    print(f"{args.model}: {path}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    pulled = {m.name: m for m in list_pulled()}
    print(f"{'NAME':<16} {'SIZE':>9}  {'ARCH':<8} {'QUANT':<8} STATUS")
    for name in sorted(set(CATALOG) | set(pulled)):
        model = pulled.get(name)
        if model:
            print(
                f"{name:<16} {_human_size(model.size_bytes):>9}  {model.architecture:<8} {model.quantization:<8} pulled"
            )
        else:
            print(f"{name:<16} {'-':>9}  {'-':<8} {'-':<8} not pulled ({CATALOG[name].description})")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    params = _sampling(args)  # bad sampling flags fail before the model loads
    llm = _llm(args)
    prompt: str | list[int] = args.prompt
    if not args.raw and llm.tokenizer.chat_template:
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    for text in llm.stream(prompt, params):
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _llm(args)
    if not llm.tokenizer.chat_template:
        raise ValueError(f"{args.model} has no chat template (a base model?); use `folio run --raw` instead")
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    if interactive:
        print("Type a message; /bye or Ctrl-D to quit, /clear to start over.", file=sys.stderr)
    while True:
        if interactive:
            sys.stderr.write(">>> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line or line.strip() == "/bye":
            return 0
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.strip() == "/clear":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": text})
        reply = []
        for piece in llm.stream(llm.tokenizer.encode_chat(messages), _sampling(args)):
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})


_SAMPLING_KEYS = (*_SAMPLING_FLAGS, "stop_token_ids", "ignore_eos")  # what a `folio generate` line may set


def cmd_generate(args: argparse.Namespace) -> int:
    records = _read_jsonl(Path(args.input))
    llm = _llm(args)
    prompts: list[str | list[int]] = []
    params: list[SamplingParams] = []
    for number, record in enumerate(records, start=1):
        overrides = {k: record[k] for k in _SAMPLING_KEYS if k in record}
        try:
            params.append(_sampling(args, **overrides))
            if "messages" in record:
                prompts.append(llm.tokenizer.encode_chat(record["messages"]))
            elif isinstance(record.get("prompt"), str):
                prompts.append(record["prompt"])
            else:
                raise ValueError('each line needs "prompt" (a string) or "messages"')
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{args.input} line {number}: {exc}") from None
    outputs = llm.generate(prompts, params)
    with open(args.output, "w", encoding="utf-8") as out:
        for record, result in zip(records, outputs, strict=True):
            completion = result.outputs[0]
            row = {
                **{k: record[k] for k in ("id", "prompt", "messages") if k in record},
                "text": completion.text,
                "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
                "prompt_tokens": len(result.prompt_token_ids),
                "completion_tokens": len(completion.token_ids),
                "time_to_first_token_s": result.metrics.time_to_first_token,
                "latency_s": result.metrics.latency,
            }
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(outputs)} completions to {args.output}", file=sys.stderr)
    return 0


def _chat_options(args: argparse.Namespace) -> ChatOptions:
    return ChatOptions(tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)


def cmd_run_batch(args: argparse.Namespace) -> int:
    path = Path(args.input_file)
    if not path.exists():
        raise FileNotFoundError(f"input file {path} does not exist")
    lines = batch_lines(path.read_bytes())  # a line that is not UTF-8 is that line's error, not the file's
    if not lines:
        raise ValueError(f"{path} holds no requests")
    core = EngineCore.from_engine_args(EngineArgs.from_cli_args(args))
    server = build_server(core, args.model, ServerOptions(limits=request_limits(args), chat=_chat_options(args)))
    try:
        with tqdm(total=len(lines), unit="request", disable=None) as bar:
            batch = run_batch(server.app, lines, core.scheduler_config.max_num_seqs, bar.update)
            outputs, summary = asyncio.run(batch)
    finally:
        server.engine.shutdown()
    with atomic_open(Path(args.output_file)) as out:
        out.writelines(line + "\n" for line in outputs)  # each already one line of strict JSON
    print(f"{summary.requests} requests: {summary.answered_ok} answered, {summary.answered_error} answered with "
          f"an error, {summary.invalid_lines} not requests, {summary.failed} failed; wrote {args.output_file}",
          file=sys.stderr)  # fmt: skip
    return 0


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise FileNotFoundError(f"input file {path} does not exist")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {number} is not valid JSON: {exc.msg}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path} line {number} must be a JSON object")
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no prompts")
    return records


def cmd_serve(args: argparse.Namespace) -> int:
    if args.max_queue < 0:
        raise ValueError("--max-queue must be >= 0")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("the API key (--api-key or FOLIO_API_KEY) is empty; give a real key, or unset it")
    adapters = [LoRAModule.parse(text) for text in args.lora_modules]
    options = ServerOptions(args.max_queue, args.api_key, args.grace_period, request_limits(args), _chat_options(args),
                            adapters, args.runtime_lora, ui=args.ui)  # fmt: skip
    many = len(args.models) != 1 or args.models_dir is not None
    # Among several models, only those with adapters (or all, with --runtime-lora) load with LoRA slots.
    args.enable_lora = args.enable_lora or args.runtime_lora or (bool(adapters) and not many)
    replicated = args.replicas is not None or args.max_replicas is not None or args.min_replicas is not None
    if many and (replicated or args.disaggregate):
        raise ValueError("Ray replicas serve one model: name exactly one MODEL (and no --models-dir)")
    if (args.enable_lora or adapters) and (replicated or args.disaggregate):
        raise ValueError("Ray replicas serve no LoRA adapters yet: serve the model with one engine (no "
                         "--replicas, --min/--max-replicas or --disaggregate)")  # fmt: skip
    args.model = args.models[0] if not many else DEFAULT_MODEL  # each model's own replaces it when it loads
    if replicated or args.disaggregate:
        return _serve_replicas(args, options)
    try:
        with sigterm_stops_startup():
            if many:
                sources = ModelSources(args.models, args.models_dir)
                manager = ManagerOptions(args.max_loaded_models, keep_alive_seconds(args.keep_alive),
                                         models_memory(args), spare_engine=args.spare_engine)  # fmt: skip
                serve_models(sources, EngineArgs.from_cli_args(args), args.host, args.port, options, manager)
            else:
                serve(EngineArgs.from_cli_args(args), args.host, args.port, options, args.engine_process)
    except StartupInterrupted:
        print("folio: SIGTERM before the server started; stopped", file=sys.stderr)
    return 0


def models_memory(args: argparse.Namespace) -> int:
    """--models-memory, or 80% of the memory free now on the device the models run on."""
    if args.models_memory is not None:
        return parse_memory(args.models_memory)
    device = torch.device(args.device) if args.device else default_device()
    return int(available_memory(device) * 0.8)


def _serve_replicas(args: argparse.Namespace, options: ServerOptions) -> int:
    bind_address(args.host, args.port).close()  # fail before starting Ray and loading replicas
    same = ("min_replicas", "max_replicas", "cpus_per_replica", "ray_address", "disaggregate", "prefill_replicas")
    replicas = ReplicaOptions(
        replicas=args.replicas if args.replicas is not None else 1,
        target_ongoing_requests=args.autoscale_target,
        downscale_delay=args.downscale_delay,
        routing=RoutingConfig(policy=args.routing, imbalance_bound=args.routing_imbalance),
        **{name: getattr(args, name) for name in same},
    )
    try:  # Ray is an optional extra: only this command needs it
        from folio.scale_out.deploy import serve_on_ray
    except ImportError as exc:
        raise ValueError(f"serving replicas needs Ray Serve: pip install 'folio[ray]' ({exc})") from None
    serve_on_ray(EngineArgs.from_cli_args(args), args.host, args.port, options, replicas)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    parallel = ParallelConfig(
        **{f.name: getattr(args, f.name) for f in fields(ParallelConfig) if hasattr(args, f.name)}
    )
    return run_worker_host(parallel, args.device or str(default_device()))


def request_limits(args: argparse.Namespace) -> RequestLimits:
    """The limits parser.py's `request limits` flags set."""
    given = {name: getattr(args, flag[2:].replace("-", "_")) for flag, (name, _) in LIMIT_FLAGS.items()}
    return RequestLimits(**given, priority_range=_priority_range(args.scheduling_policy, args.priority_range))


def _priority_range(policy: str, given: str | None) -> tuple[int, int] | None:
    if policy == "fcfs":
        if given is not None:
            raise ValueError("--priority-range needs --scheduling-policy priority")
        return None
    if given is None:
        return (INT64_MIN, INT64_MAX)
    low, sep, high = given.partition(":")
    try:
        bounds = (int(low), int(high))
    except ValueError:
        sep = ""
    if not sep or not INT64_MIN <= bounds[0] <= bounds[1] <= INT64_MAX:
        raise ValueError(f"--priority-range takes LOW:HIGH, two 64-bit integers with LOW <= HIGH; got {given!r}")
    return bounds
