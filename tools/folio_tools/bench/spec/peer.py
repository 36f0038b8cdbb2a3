"""llama.cpp's llama-server as the peer of `folio bench spec`: the same GGUF file, one slot (concurrency 1),
without speculation, with its own n-gram speculation (`--spec-type ngram-simple`: the last n tokens looked
up earlier in the context, the m after them drafted) and, given a draft model, with it (`--spec-type
draft-simple -md DRAFT`: with `-md` alone, llama-server 0.3.36 loads the draft but never drafts). Each
configuration runs the same workloads through `spec_served.sweep`; the drafts it accepted come from the
`timings` llama-server sends with every response (`draft_n`, `draft_n_accepted`); its MFU is folio's served
one (spec_served.py), the same FLOPs of the same model over its wall time.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from folio.config import SpeculativeConfig
from folio.loaders.catalog import resolve_model
from folio_tools.bench.harness.roofline import MachinePeaks, TokenCost
from folio_tools.bench.peers.llama_cpp_build import build_llama_cpp
from folio_tools.bench.peers.llama_cpp_server import _help_text, server_command
from folio_tools.bench.serve.client import ServeRequest
from folio_tools.bench.serve_compare.command import ServerSpec, running_server
from folio_tools.bench.serve_compare.peers import STARTUP_TIMEOUT_S, default_ctx_size
from folio_tools.bench.spec.served import sweep
from folio_tools.bench.spec.values import Cell, PeerVariant, SpecConfig

PEERS = ("llama.cpp", "none")
PEER_LEVEL = 1  # llama-server runs one slot: batch 1 served


def peer_variants(
    speculative: SpeculativeConfig, draft_model: str | None, extra: str | None = None
) -> list[PeerVariant]:
    """llama-server's configurations: drafting as many tokens at most as folio (`--num-speculative-tokens`),
    n-gram lookups of folio's longest (`--prompt-lookup-max`), and `extra` (shell words) added to each one
    that speculates. A draft model that is not a GGUF file has no llama-server configuration."""
    k = str(speculative.num_speculative_tokens)
    more = tuple(shlex.split(extra or ""))
    ngram = ("--spec-type", "ngram-simple", "--spec-draft-n-max", k, "--spec-ngram-simple-size-n",
             str(speculative.prompt_lookup_max), "--spec-ngram-simple-size-m", k)  # fmt: skip
    variants = [PeerVariant("none", "none", ()), PeerVariant("ngram", "ngram", ngram + more)]
    if draft_model is not None:
        path = resolve_model(draft_model)
        if path.suffix.lower() == ".gguf":
            draft = ("--spec-type", "draft-simple", "-md", str(path), "--spec-draft-n-max", k)
            variants.append(PeerVariant("draft", "draft", draft + more))
        else:
            print(f"folio: llama.cpp gets no draft configuration: {draft_model} is not a GGUF file", file=sys.stderr)
    return variants


def check_flags(help_text: str, variants: list[PeerVariant], version: str) -> None:
    """Fail before any server starts when the built llama-server lacks a flag of a configuration."""
    for variant in variants:
        for word in variant.args:
            if word.startswith("-") and f"{word} " not in help_text and f"{word}," not in help_text:
                raise ValueError(f"llama-server of llama-cpp-python {version} has no {word} (for {variant.name}); "
                                 "give --peer none or build a newer one")  # fmt: skip


def llama_specs(config: SpecConfig, longest_prompt: int) -> list[tuple[PeerVariant, ServerSpec]]:
    """A llama-server command line per configuration, all checked before any server starts."""
    path = resolve_model(config.model)
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"--peer llama.cpp needs a GGUF model, and {config.model} is {path}")
    binaries = build_llama_cpp()
    help_text = _help_text(binaries.server)
    check_flags(help_text, config.peer_variants, binaries.version)
    ctx_size = default_ctx_size(PEER_LEVEL, longest_prompt, config.max_tokens)
    cont_batching = "--cont-batching" in help_text
    info = {"version": binaries.version, "llama_cpp_commit": binaries.commit, "ctx_size": ctx_size}
    specs = []
    for variant in config.peer_variants:

        def argv(port: int, variant: PeerVariant = variant) -> list[str]:
            extra = ["--alias", config.model, *variant.args]
            return server_command(binaries, path, port, ctx_size=ctx_size, parallel=PEER_LEVEL,
                                  threads=config.llama_threads, cont_batching_flag=cont_batching,
                                  extra_args=extra)  # fmt: skip

        specs.append((variant, ServerSpec(f"llama.cpp {variant.name}", argv, {"cache_prompt": False}, info)))
    return specs


def run_peer(
    config: SpecConfig,
    specs: list[tuple[PeerVariant, ServerSpec]],
    workloads: dict[str, list[ServeRequest]],
    log_dir: Path,
    servers: list[dict[str, str]],
    cost: TokenCost,
    peaks: MachinePeaks,
) -> list[Cell]:
    """Each llama-server configuration in turn over every workload at concurrency 1, MFU from `cost` and
    `peaks`."""
    cells: list[Cell] = []
    for variant, spec in specs:
        log = log_dir / f"llama.cpp-{variant.name}.log"
        with running_server(spec, log, STARTUP_TIMEOUT_S) as (url, line):
            print(f"folio: [{spec.name}] {line}", file=sys.stderr, flush=True)
            servers.append({"name": spec.name, "command": line})
            describe = {"engine": "llama.cpp", "variant": variant.name, "method": variant.method, "baseline": "none"}
            body = {**spec.extra_body, "ignore_eos": config.ignore_eos}
            cells += sweep(url, config, workloads, [PEER_LEVEL], describe, "llama.cpp timings", body, cost, peaks)
    return cells
