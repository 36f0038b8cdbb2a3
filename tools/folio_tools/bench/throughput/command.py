"""Offline throughput: every request submitted at once to `LLM.generate`, optionally the same requests
through a peer engine in the same run, reported side by side."""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from folio import LLM
from folio.engine_args import EngineArgs
from folio.loaders.catalog import resolve_model
from folio.platform import default_device, default_threads, resolve_dtype
from folio_tools.bench.harness.datasets import (
    DATASETS,
    BenchRequest,
    LengthRange,
    humaneval_path,
    humaneval_requests,
    prompt_vocabulary,
    random_requests,
)
from folio_tools.bench.harness.flags import add_output_dir, command_line
from folio_tools.bench.harness.roofline import TokenCost, measure_peaks
from folio_tools.bench.harness.sampling import BenchSampling, add_sampling_args, sampling_from_args
from folio_tools.bench.peers.hf import load_hf_model, require_transformers, run_hf
from folio_tools.bench.throughput.report import EngineResult, ThroughputReport, format_table, write_report

PEERS = ("hf",)


@dataclass
class ThroughputConfig:
    model: str
    input_len_range: LengthRange
    output_len_range: LengthRange
    dataset: str = "random"
    num_prompts: int = 256
    seed: int = 0
    peer: str | None = None
    hf_batch_size: int = 16
    sampling: BenchSampling = field(default_factory=BenchSampling)
    engine_args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of folio.LLM
    use_tqdm: bool = True

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r}; choose from {', '.join(DATASETS)}")
        if self.peer is not None and self.peer not in PEERS:
            raise ValueError(f"unknown peer {self.peer!r}; choose from {', '.join(PEERS)}")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be at least 1, got {self.num_prompts}")
        if self.hf_batch_size < 1:
            raise ValueError(f"--hf-batch-size must be at least 1, got {self.hf_batch_size}")


def build_requests(config: ThroughputConfig, llm: Any) -> list[BenchRequest]:
    if config.dataset == "humaneval":
        return humaneval_requests(llm.tokenizer.encode, config.num_prompts, config.output_len_range, config.seed)
    special = set(llm.model_config.eos_token_ids)
    if llm.model_config.bos_token_id is not None:
        special.add(llm.model_config.bos_token_id)
    vocabulary = prompt_vocabulary(llm.tokenizer.backend, llm.model_config.vocab_size, special)
    return random_requests(vocabulary, config.num_prompts, config.input_len_range, config.output_len_range, config.seed)


def check_fits(requests: list[BenchRequest], max_model_len: int) -> None:
    """Refuse a workload the engine would cut short: every request must fit the context whole."""
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    if longest > max_model_len:
        raise ValueError(
            f"a request needs {longest} tokens (prompt + output) but the model's context is {max_model_len}; "
            "shorten --input-len-range/--output-len-range or raise --max-model-len"
        )


def run_folio(
    llm: Any,
    requests: list[BenchRequest],
    load_s: float,
    use_tqdm: bool = True,
    sampling: BenchSampling | None = None,
    seed: int = 0,
) -> EngineResult:
    """Time one `generate` call over all requests: greedy (or sampled, request i seeded seed + i),
    ignoring EOS, each to its own length."""
    torch.set_num_threads(default_threads())
    sampling = sampling or BenchSampling()
    params = [sampling.folio_params(r.output_len, seed + i) for i, r in enumerate(requests)]
    prompts = [r.prompt_token_ids for r in requests]
    preempted = llm.engine.make_stats().num_preemptions
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    preempted = llm.engine.make_stats().num_preemptions - preempted
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    wanted = sum(r.output_len for r in requests)
    if generated != wanted:
        raise RuntimeError(f"folio generated {generated} output tokens but the requests asked for {wanted}")
    return EngineResult(
        engine="folio",
        num_requests=len(requests),
        prompt_tokens=sum(len(p) for p in prompts),
        output_tokens=generated,
        generated_tokens=generated,
        elapsed_s=elapsed,
        load_s=load_s,
        threads=torch.get_num_threads(),
        preemptions=preempted,
    )


def run_throughput(config: ThroughputConfig, command: str) -> ThroughputReport:
    # Fail before the long part of the run on anything the user can fix.
    if config.peer == "hf":
        require_transformers()
    if config.dataset == "humaneval":
        humaneval_path()
    date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    path = resolve_model(config.model)  # pulls a catalog model now, so the download is not load time
    torch.set_num_threads(default_threads())
    peaks = measure_peaks(resolve_dtype(config.engine_args.get("dtype") or "float32", default_device())[0])

    start = time.perf_counter()
    llm = LLM(path, **config.engine_args)
    load_s = time.perf_counter() - start
    requests = build_requests(config, llm)
    check_fits(requests, llm.engine.max_model_len)
    results = [run_folio(llm, requests, load_s, config.use_tqdm, config.sampling, config.seed)]
    model_path, dtype = llm.loaded.path, llm.dtype
    cost = TokenCost.of(path, llm.loaded.step_weight_bytes(config.sampling.greedy), llm.engine.kv_bytes_per_token)
    kv = llm.engine.kv
    kv_pool = {"blocks": kv.pool.num_blocks, "block_tables": kv.num_groups, "tokens": kv.capacity_tokens}
    del llm  # free folio's weights and KV pool before the peer loads its own copy
    gc.collect()

    if config.peer == "hf":
        model, hf_load_s = load_hf_model(model_path, dtype)
        choice = config.sampling.hf_generate_kwargs()
        results.append(run_hf(model, requests, config.hf_batch_size, hf_load_s, config.use_tqdm, choice))
        del model
        gc.collect()

    work = sum(cost.sequence_flops(len(r.prompt_token_ids) + r.output_len) for r in requests)
    for result in results:
        result.mfu = work / result.elapsed_s / (peaks.matmul_gflops * 1e9)
    return ThroughputReport(
        peaks=peaks.to_dict(),
        command=command,
        date_utc=date,
        model=config.model,
        model_path=str(model_path),
        dtype=str(dtype).removeprefix("torch."),
        dataset=config.dataset,
        seed=config.seed,
        num_prompts=config.num_prompts,
        settings={
            "input_len_range": str(config.input_len_range) if config.dataset == "random" else None,
            "output_len_range": str(config.output_len_range),
            "peer": config.peer,
            "hf_batch_size": config.hf_batch_size if config.peer == "hf" else None,
            "sampling": config.sampling.to_dict(),
            "engine": {k: v for k, v in config.engine_args.items() if k != "dtype"},
            "mean_prompt_tokens": sum(len(r.prompt_token_ids) for r in requests) / len(requests),
            "mean_output_tokens": sum(r.output_len for r in requests) / len(requests),
            "kv_pool": kv_pool,
        },
        results=results,
    )


def add_parser(benchmarks: argparse._SubParsersAction) -> None:
    parser = benchmarks.add_parser(
        "throughput",
        help="offline throughput: all requests at once, optionally vs transformers",
        description="Submit a fixed, seeded set of requests at once and measure requests/s and tokens/s "
        "(greedy unless --temperature is above 0; EOS ignored, so every request decodes exactly its output "
        "length).",
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
    add_sampling_args(parser)
    add_output_dir(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(bench_run=run_throughput_command)


def run_throughput_command(args: argparse.Namespace) -> int:
    config = ThroughputConfig(
        model=args.model,
        input_len_range=LengthRange.parse(args.input_len_range, "--input-len-range"),
        output_len_range=LengthRange.parse(args.output_len_range, "--output-len-range"),
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        seed=args.seed,
        peer=args.peer,
        hf_batch_size=args.hf_batch_size,
        sampling=sampling_from_args(args),
        engine_args=EngineArgs.from_cli_args(args).llm_kwargs(),
    )
    report = run_throughput(config, command_line(args))
    print(f"{report.model} ({report.dtype}), {report.dataset}, {report.num_prompts} requests, seed {report.seed}")
    print(format_table(report))
    json_path, png_path = write_report(report, Path(args.output_dir))
    print(f"wrote {json_path}")
    print(f"wrote {png_path}")
    return 0
