"""The servers `folio bench serve-compare` can start: folio serve itself, its variants, and llama.cpp's
llama-server. `PEERS` is a registry of launchers: a launcher turns the run's config into a `ServerSpec` (the
command line for a port, the extra request body, facts for the report). Tests register their own peer there.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from folio import __version__
from folio.config import parse_memory
from folio.engine_args import EngineArgs
from folio.loaders.catalog import resolve_model
from folio_tools.bench.peers.llama_cpp_build import build_llama_cpp
from folio_tools.bench.peers.llama_cpp_server import _help_text, server_command
from folio_tools.bench.serve.command import ServeConfig
from folio_tools.bench.serve.workload import build_serve_requests, load_tokenizer
from folio_tools.bench.serve_compare.values import LlamaOptions, ServerSpec

STARTUP_TIMEOUT_S = 600.0  # a first start may build kernels or load a large model
SLOT_MARGIN = 64  # tokens per llama-server slot beyond prompt + output: re-tokenized prompts, chat templates


@dataclass
class CompareConfig:
    model: str  # catalog name or path, as typed; also the model name sent in every request
    workload: ServeConfig  # its base_url and extra_body are replaced by each server's
    peer: str = "llama.cpp"
    engine_args: EngineArgs = field(default_factory=EngineArgs)  # folio serve's engine flags
    llama: LlamaOptions = field(default_factory=LlamaOptions)
    startup_timeout_s: float = STARTUP_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.peer not in PEERS:
            raise ValueError(f"unknown --peer {self.peer!r}; choose from {', '.join(sorted(PEERS))}")


PeerLauncher = Callable[[CompareConfig], ServerSpec]


def folio_spec(config: CompareConfig) -> ServerSpec:
    engine = config.engine_args.to_cli_flags()
    # Room in the queue for every request of a rate, so folio queues them as llama-server does instead of a 429.
    queue = ["--max-queue", str(config.workload.num_prompts)]

    def argv(port: int) -> list[str]:
        host = ["--host", "127.0.0.1", "--port", str(port)]
        return [sys.executable, "-m", "folio.cli", "serve", config.model, *host, *queue, *engine]

    return ServerSpec("folio", argv, info={"version": __version__, **config.engine_args.llm_kwargs()})


def folio_no_prefix_cache_spec(config: CompareConfig) -> ServerSpec:
    """folio serve as folio_spec starts it, with its prefix cache turned off."""
    engine_args = replace(config.engine_args, enable_prefix_caching=False)
    return replace(folio_spec(replace(config, engine_args=engine_args)), name="folio-no-prefix-cache")


def folio_no_kv_tiers_spec(config: CompareConfig) -> ServerSpec:
    """folio serve as folio_spec starts it, without its KV tiers (--kv-offload-ram, --kv-cache-dir): the prefix
    cache holds what the pool holds, no more."""
    engine_args = replace(config.engine_args, kv_offload_ram=None, kv_cache_dir=None, kv_cache_disk=None)
    return replace(folio_spec(replace(config, engine_args=engine_args)), name="folio-no-kv-tiers")


def folio_batching_spec(policy: str) -> PeerLauncher:
    """folio serve as folio_spec starts it, with request-level batching (`--batching static|dynamic`)."""

    def spec(config: CompareConfig) -> ServerSpec:
        engine_args = replace(config.engine_args, batching=policy)
        spec = folio_spec(replace(config, engine_args=engine_args))
        return replace(spec, name=f"folio-{policy}", probe_request=policy != "static")

    return spec


def folio_engine_process_spec(config: CompareConfig) -> ServerSpec:
    """folio serve as folio_spec starts it, with the engine in a process of its own (`--engine-process`)."""
    folio = folio_spec(config)
    return replace(folio, name="folio-engine-process", argv=lambda port: [*folio.argv(port), "--engine-process"],
                   info={**folio.info, "engine_process": True})  # fmt: skip


REPLICA_METRICS_LAG_S = 2.5  # the ingress refreshes the replicas' metrics at most once a second, so ~1-2 s behind


def folio_replicas_spec(
    name: str, routing: str, replicas: int = 2, cpus: int = 1, disaggregate: bool = False
) -> PeerLauncher:
    """folio serve as folio_spec starts it, on `replicas` Ray Serve replicas of `cpus` CPUs each, routed by
    `routing`. One replica of every core measures what the Ray path itself costs; `disaggregate` makes
    them one prefill replica and `replicas - 1` decode replicas."""
    flags = ["--cpus-per-replica", str(cpus)]
    flags += ["--disaggregate", "--prefill-replicas", "1", "--replicas", str(replicas - 1)] if disaggregate else [
        "--replicas", str(replicas)]  # fmt: skip
    if routing != "cache_aware":  # folio serve's default
        flags += ["--routing", routing]

    def spec(config: CompareConfig) -> ServerSpec:
        folio = folio_spec(config)
        info = {**folio.info, "replicas": replicas, "cpus_per_replica": cpus, "routing": routing,
                "disaggregated": disaggregate}  # fmt: skip
        return replace(folio, name=name, argv=lambda port: [*folio.argv(port), *flags], info=info,
                       metrics_lag_s=REPLICA_METRICS_LAG_S)  # fmt: skip

    return spec


def default_ctx_size(parallel: int, longest_prompt: int, longest_output: int) -> int:
    """Enough KV tokens for every slot to hold the longest request; each slot rounded up to 256 tokens."""
    per_slot = math.ceil((longest_prompt + longest_output + SLOT_MARGIN) / 256) * 256
    return parallel * per_slot


def longest_prompt(workload: ServeConfig) -> int:
    """Prompt tokens of the longest request: the top of --input-len-range for random and chat, else (prompts
    not drawn to a length) the longest prompt of the workload itself. A multi-turn prompt also gets room for
    the chat template's tokens around each of its messages."""
    if workload.dataset in ("random", "chat"):
        return workload.input_len_range.high

    tokenizer = load_tokenizer(workload.tokenizer or workload.model, explicit=workload.tokenizer is not None)
    requests = build_serve_requests(
        workload.dataset, tokenizer, workload.num_prompts, workload.input_len_range, workload.output_len_range,
        workload.seed, workload.dataset_path, turns=workload.turns, document_len=workload.document_len,
        tenants=workload.tenants,
    ).requests  # fmt: skip
    return max(r.prompt_len + 8 * len(r.messages or ()) for r in requests)


def llama_cpp_spec(config: CompareConfig) -> ServerSpec:
    path = resolve_model(config.model)
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"--peer llama.cpp needs a GGUF model, and {config.model} is {path}")
    binaries = build_llama_cpp(version=config.llama.version)
    options = config.llama
    workload = config.workload
    ctx_size = options.ctx_size or default_ctx_size(
        options.parallel, longest_prompt(workload), workload.output_len_range.high
    )
    cont_batching = "--cont-batching" in _help_text(binaries.server)

    def argv(port: int) -> list[str]:
        # --alias: /v1/models then lists the same name that folio serves and every request sends.
        return server_command(binaries, path, port, ctx_size=ctx_size, parallel=options.parallel,
                              threads=options.threads, cont_batching_flag=cont_batching,
                              extra_args=["--alias", config.model])  # fmt: skip

    info = {
        "version": binaries.version,
        "llama_cpp_commit": binaries.commit,
        "model_path": str(path),
        "parallel": options.parallel,
        "ctx_size": ctx_size,
        "ctx_per_slot": ctx_size // options.parallel,
        "threads": options.threads,
    }
    return ServerSpec("llama.cpp", argv, extra_body=dict(options.extra_body), info=info)


def llama_cpp_cache_ram_spec(config: CompareConfig) -> ServerSpec:
    """llama-server as llama_cpp_spec starts it, with its prompt cache on (`cache_prompt`) and `--cache-ram`:
    prompts' KV kept in host RAM once their slot moves on, as much as folio's --kv-offload-ram (else
    llama.cpp's default, 8 GiB)."""
    spec = llama_cpp_spec(config)
    if "--cache-ram" not in _help_text(build_llama_cpp(version=config.llama.version).server):
        raise ValueError("this llama.cpp build has no --cache-ram (added in 2025-10); give a newer --llama-version")
    ram = parse_memory(config.engine_args.kv_offload_ram)
    mib = ram // 2**20 if ram is not None else 8192
    return replace(spec, name="llama.cpp-cache-ram", argv=lambda port: [*spec.argv(port), "--cache-ram", str(mib)],
                   extra_body={**spec.extra_body, "cache_prompt": True},
                   info={**spec.info, "cache_ram_mib": mib})  # fmt: skip


PEERS: dict[str, PeerLauncher] = {
    "llama.cpp": llama_cpp_spec,
    "llama.cpp-cache-ram": llama_cpp_cache_ram_spec,
    "folio-no-kv-tiers": folio_no_kv_tiers_spec,
    "folio-no-prefix-cache": folio_no_prefix_cache_spec,
    "folio-static": folio_batching_spec("static"),
    "folio-dynamic": folio_batching_spec("dynamic"),
    "folio-engine-process": folio_engine_process_spec,
    "folio-replicas": folio_replicas_spec("folio-replicas", "cache_aware"),
    "folio-replicas-round-robin": folio_replicas_spec("folio-replicas-round-robin", "round_robin"),
    "folio-ray-1": folio_replicas_spec("folio-ray-1", "cache_aware", replicas=1, cpus=2),
    "folio-disaggregated": folio_replicas_spec("folio-disaggregated", "cache_aware", disaggregate=True),
}
