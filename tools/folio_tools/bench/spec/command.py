"""`folio bench spec`: speculative decoding measured side by side in one run.

Each method of `--methods` (none, and every `folio.config.SPECULATIVE_METHODS` entry: passed to folio as
`--speculative-method M` with the run's other engine flags) is measured on each workload (spec_workloads.py:
grounded code edits whose answers copy the prompt, rewrites of a given text, ShareGPT chat)
- in process at batch 1 (spec_offline.py): every variant loaded once, the requests sent one at a time to
  each in turn; output tok/s, TPOT, and the drafts accepted from the engine's counters;
- served (spec_served.py): a `folio serve` per variant, one at a time, at each `--concurrency`; the drafts
  accepted from its /metrics;
- and, with `--peer llama.cpp`, llama-server on the same GGUF at concurrency 1 (spec_peer.py), without
  speculation, with its n-gram speculation and with the draft model; the drafts from its responses.
Every speedup is output tok/s over the baseline's at the same workload and setting. The draft model's case
(a GGUF target served dense, drafted by the same file kept 4-bit) runs its target at
`--draft-target-quantization` (none: dense); when that differs from the run's `--quantization`, the target
alone at that quantization runs too, as the draft's baseline.
Every cell has its MFU and a batch-1 cell its MBU (spec_types.py's `Cell`: effective utilisation under
speculation), against the machine's peaks measured before the first run in the run's --dtype (llama-server's
cells too, as `folio bench decode` measures its peer).
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path

from folio.config import SPECULATIVE_METHODS, SpeculativeConfig
from folio.engine_args import QUANTIZATION_CHOICES, EngineArgs
from folio.platform import default_device, resolve_dtype
from folio_tools.bench.harness.datasets import LengthRange
from folio_tools.bench.harness.flags import add_output_dir, command_line
from folio_tools.bench.harness.roofline import TokenCost, measure_peaks
from folio_tools.bench.serve.workload import load_tokenizer
from folio_tools.bench.serve_compare.command import server_session
from folio_tools.bench.spec.offline import run_offline
from folio_tools.bench.spec.peer import PEERS, llama_specs, peer_variants, run_peer
from folio_tools.bench.spec.report import add_speedups, format_table, write_report
from folio_tools.bench.spec.served import run_folio_served
from folio_tools.bench.spec.values import SpecConfig, SpecReport, Variant
from folio_tools.bench.spec.workloads import WORKLOADS, build_workload
from folio_tools.results import machine_info

BASELINE = "none"


def check_methods(methods: list[str], draft_model: str | None) -> None:
    """One line for a method this folio does not have, a repeated one, no baseline, or a draft without a model."""
    known = (BASELINE, *SPECULATIVE_METHODS)
    for method in methods:
        if method not in known:
            raise ValueError(f"--methods: unknown speculative method {method!r}; this folio has {', '.join(known)}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"--methods names a method twice: {' '.join(methods)}")
    if BASELINE not in methods:
        raise ValueError("--methods must include none: every speedup is measured against it")
    if "draft" in methods and draft_model is None:
        raise ValueError("--methods draft needs --draft-model")


def engine_args_for(args: argparse.Namespace, method: str, quantization: str | None) -> EngineArgs:
    """The run's engine flags with `--speculative-method method` (none: without), read back as `folio serve`
    reads them, so a method's own flags pass straight through."""
    flags = argparse.Namespace(**vars(args))
    flags.speculative_method = None if method == BASELINE else method
    if method != "draft":
        flags.draft_model = flags.draft_quantization = None
    flags.quantization = quantization
    return EngineArgs.from_cli_args(flags)


def build_variants(args: argparse.Namespace) -> list[Variant]:
    """A variant per method; the draft's target alone too when it runs at its own quantization."""
    variants = []
    for method in args.methods:
        if method != "draft":
            variants.append(Variant(method, method, BASELINE, engine_args_for(args, method, args.quantization)))
            continue
        target = args.quantization if args.draft_target_quantization == "keep" else args.draft_target_quantization
        baseline = BASELINE
        if target != args.quantization:
            baseline = "none-dense" if target == "none" else f"none-{target}"
            variants.append(Variant(baseline, BASELINE, baseline, engine_args_for(args, BASELINE, target)))
        variants.append(Variant(method, method, baseline, engine_args_for(args, method, target)))
    return variants


def run_spec(config: SpecConfig, command: str) -> SpecReport:
    date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    bench_tokenizer = load_tokenizer(config.model, explicit=False)
    tokenizer = bench_tokenizer.tokenizer
    alone = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731 - the message's tokens
    workloads = {
        name: build_workload(
            name, alone, config.num_prompts, config.input_len_range, config.max_tokens, config.seed, config.dataset_path
        )  # fmt: skip
        for name in config.workloads
    }
    longest = max(r.prompt_len for requests in workloads.values() for r in requests)
    peer_specs = llama_specs(config, longest) if config.peer == "llama.cpp" else []  # fail before any run
    if config.served and config.num_prompts < max(config.concurrency):
        print(f"folio: only {config.num_prompts} requests at concurrency {max(config.concurrency)}: "
              "give --num-prompts at least the highest --concurrency to keep it full", file=sys.stderr)  # fmt: skip
    # Before any model takes memory or cores; the variants share the run's --dtype.
    peaks = measure_peaks(resolve_dtype(config.variants[0].engine_args.dtype, default_device())[0])
    cost = TokenCost.of(bench_tokenizer.path, 0, 0)  # served: FLOPs only, the servers' resident bytes are their own
    cells, loads, servers = [], {}, []
    if config.offline:
        prompts = {
            name: [tokenizer.encode_chat([{"role": "user", "content": r.prompt}]) for r in requests]
            for name, requests in workloads.items()
        }
        offline_cells, loads = run_offline(config.variants, prompts, config.max_tokens, config.ignore_eos, peaks)
        cells += offline_cells
    with server_session("folio-bench-spec-") as log_dir:
        if config.served:
            cells += run_folio_served(config, workloads, log_dir, servers, cost, peaks)
        cells += run_peer(config, peer_specs, workloads, log_dir, servers, cost, peaks)
    add_speedups(cells)
    return SpecReport(command, date, config, machine_info(), cells, servers, loads, peaks.to_dict())


def run_spec_command(args: argparse.Namespace) -> int:
    """The runner `folio bench spec` stores in `args.bench_run`."""
    check_methods(args.methods, args.draft_model)
    if args.speculative_method is not None:
        raise ValueError("folio bench spec takes its methods from --methods, not --speculative-method")
    if args.peer not in PEERS:
        raise ValueError(f"unknown --peer {args.peer!r}; choose from {', '.join(PEERS)}")
    speculative = SpeculativeConfig(num_speculative_tokens=args.num_speculative_tokens,
                                    prompt_lookup_max=args.prompt_lookup_max)  # fmt: skip
    config = SpecConfig(
        model=args.model, variants=build_variants(args), workloads=args.workloads, num_prompts=args.num_prompts,
        max_tokens=args.max_tokens, input_len_range=LengthRange.parse(args.input_len_range, "--input-len-range"),
        seed=args.seed, concurrency=args.concurrency, offline=args.offline, served=args.served, peer=args.peer,
        peer_variants=peer_variants(speculative, args.draft_model, args.llama_spec_args) if args.peer != "none" else [],
        ignore_eos=not args.stop_at_eos, llama_threads=args.llama_threads, timeout_s=args.timeout,
        dataset_path=args.dataset_path,
    )  # fmt: skip
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)  # now, not after a long run
    report = run_spec(config, command_line(args))
    print(format_table(report))
    for path in write_report(report, output_dir):
        print(f"wrote {path}")
    return 1 if any(cell.completed == 0 for cell in report.cells) else 0


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "spec",
        help="speculative decoding: each method against none, in process at batch 1 and served, in one run",
        description="Measure each speculative method of --methods against none on the same workloads in one run: "
        "in process at batch 1 (every variant loaded once, requests sent one at a time to each in turn), then "
        "served (a folio serve per method, one at a time) at each --concurrency, and llama-server on the same "
        "GGUF at concurrency 1 without and with its own speculation. Reports output tok/s, TPOT, TTFT, drafts "
        "accepted and the speedup over none; prints the targets as pass/fail lines (prompt lookup and a draft model "
        "at least 2x at batch 1, every method at least 0.95x on chat at concurrency 16); writes JSON, Markdown and "
        "a plot. Engine options (--dtype, --num-speculative-tokens, --draft-model, ...) apply to every method.",
    )
    parser.add_argument("model", help="catalog name, .gguf file or Hugging Face folder (llama.cpp needs a GGUF)")
    parser.add_argument("--methods", nargs="+", default=[BASELINE, "ngram"], metavar="METHOD",
                        help=f"configurations to compare: none and any of {', '.join(SPECULATIVE_METHODS)} "
                        "(default: none ngram)")  # fmt: skip
    parser.add_argument("--workloads", nargs="+", default=["grounded", "chat"], choices=WORKLOADS,
                        help="grounded (HumanEval code edits), rewrite (ShareGPT texts to rework), chat (ShareGPT) "
                        "(default: grounded chat)")  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per workload (default 32)")
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens an answer may have (default 256)")
    parser.add_argument("--input-len-range", default="16:1024",
                        help="tokens of a user message kept, LOW:HIGH (default 16:1024)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the workloads' draw (default 0)")
    parser.add_argument("--dataset-path", default=None, help="rewrite, chat: a ShareGPT-format JSON file")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16], metavar="N",
                        help="served: requests in flight, one run per level (default 1 4 16)")  # fmt: skip
    # stop_at_eos, default True, so that the recorded command line (flags.command_line) reads back the same.
    parser.add_argument("--ignore-eos", "--no-stop-at-eos", dest="stop_at_eos", action="store_false",
                        help="decode every answer to --max-tokens (default: stop at EOS, as users see it)")  # fmt: skip
    parser.add_argument("--no-offline", dest="offline", action="store_false", help="skip the batch-1 runs")
    parser.add_argument("--no-served", dest="served", action="store_false", help="skip the folio serve runs")
    parser.add_argument("--draft-target-quantization", default="none", choices=(*QUANTIZATION_CHOICES, "keep"),
                        help="draft: the target's --quantization (default none: a GGUF target dense; keep: the "
                        "run's own); when it differs, the target alone runs too as the draft's baseline")  # fmt: skip
    parser.add_argument("--peer", default="llama.cpp", help="llama.cpp (default) or none")
    parser.add_argument("--llama-threads", type=int, default=2, help="llama-server threads (default 2)")
    parser.add_argument(
        "--llama-spec-args",
        default=None,
        help="more llama-server flags for its speculative runs, e.g. '--spec-draft-n-min 1'",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    add_output_dir(parser, "JSON, Markdown and PNG go")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(bench_run=run_spec_command)
