"""The batch-1 half of `folio bench spec`: every variant loaded once as an in-process `LLM`, warmed up, then
each workload's requests sent one at a time, greedy, to every variant in turn (the order rotating from one
request to the next), so that a slow spell of the machine falls on all of them alike.

Per request: its wall time (prefill included), output tokens, TTFT and TPOT from the engine's timestamps.
The drafts come from the engine's own counters (`llm.engine.make_stats().spec_decoding`), read before and after
each workload. Every answer is compared with its baseline's: greedy speculation keeps the target's tokens.
MFU and MBU (`batch1_utilisation`) count the target's shapes, the weight bytes its greedy
steps read (roofline.py) and its KV format as loaded.
"""

from __future__ import annotations

import gc
import math
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from folio import LLM, SamplingParams
from folio_tools.bench.harness.roofline import MachinePeaks, TokenCost
from folio_tools.bench.serve.stats import distribution
from folio_tools.bench.spec.counters import SpecCounts, from_engine
from folio_tools.bench.spec.values import OFFLINE, Cell, Variant

WARM_UP = "Write a short poem about a lighthouse keeper and the sea."
KV_MARGIN_BLOCKS = 2  # beyond the longest request and its drafts


@dataclass
class _Sample:
    prompt_len: int
    e2e_s: float
    output_ids: list[int]
    ttft_s: float | None
    tpot_s: float | None


def kv_blocks_for(longest_prompt: int, max_tokens: int, num_drafts: int, block_size: int) -> int:
    """KV blocks for one request at a time: its prompt, its answer and the drafts verified past it."""
    return math.ceil((longest_prompt + max_tokens + num_drafts + 1) / block_size) + KV_MARGIN_BLOCKS


def _sized(variant: Variant, longest_prompt: int, max_tokens: int) -> Variant:
    """The variant with a KV pool for one request, unless its flags size the pool: every variant is loaded
    at once, and the default (a share of free memory each) would not fit them all."""
    args = variant.engine_args
    if args.kv_cache_memory is not None or args.num_kv_blocks is not None:
        return variant
    drafts = args.speculative_config.num_speculative_tokens if args.speculative_config else 0
    blocks = kv_blocks_for(longest_prompt, max_tokens, drafts, args.block_size)
    return replace(variant, engine_args=replace(args, num_kv_blocks=blocks))


def _run_one(llm: Any, prompt_ids: list[int], params: SamplingParams) -> _Sample:
    start = time.perf_counter()
    [out] = llm.generate([prompt_ids], params, use_tqdm=False)
    e2e = time.perf_counter() - start
    ids, metrics = list(out.outputs[0].token_ids), out.metrics
    ttft = metrics.time_to_first_token
    tpot = None
    if metrics.first_token_time is not None and metrics.finish_time is not None and len(ids) > 1:
        tpot = (metrics.finish_time - metrics.first_token_time) / (len(ids) - 1)
    return _Sample(len(prompt_ids), e2e, ids, ttft, tpot)


def batch1_utilisation(lengths: list[tuple[int, int]], duration_s: float, cost: TokenCost,
                       peaks: MachinePeaks) -> dict[str, float | None]:  # fmt: skip
    """MFU and MBU of requests run one at a time, given each one's (prompt, output) tokens and their summed
    wall time: MFU the requests' FLOPs (prefill included, as in the wall time) over it; MBU output tok/s x a
    batch-1 decode step's bytes at the mean context an output token attends to (its prompt and the output
    tokens before it). A speculative variant's are effective: see `Cell`."""
    tokens = sum(n for _, n in lengths)
    if tokens == 0 or duration_s <= 0:
        return {"mfu": None, "mbu": None}
    context = sum(n * p + n * (n - 1) / 2 for p, n in lengths) / tokens
    return {"mfu": cost.requests_mfu(lengths, duration_s, peaks),
            "mbu": cost.utilisation(tokens / duration_s, 1, context, peaks)["mbu"]}  # fmt: skip


def _cell(variant: Variant, workload: str, samples: list[_Sample], spec: SpecCounts | None, matches: int | None,
          utilisation: dict[str, float | None]) -> Cell:  # fmt: skip
    return Cell(
        engine="folio", variant=variant.name, method=variant.method, baseline=variant.baseline, workload=workload,
        setting=OFFLINE, concurrency=1, num_requests=len(samples), completed=len(samples),
        output_tokens=sum(len(s.output_ids) for s in samples), duration_s=sum(s.e2e_s for s in samples),
        tpot_ms=distribution([s.tpot_s for s in samples if s.tpot_s is not None]),
        ttft_ms=distribution([s.ttft_s for s in samples if s.ttft_s is not None]),
        spec=spec if variant.method != "none" else None, matches_baseline=matches, **utilisation,
    )  # fmt: skip


def run_offline(
    variants: list[Variant],
    prompts: dict[str, list[list[int]]],
    max_tokens: int,
    ignore_eos: bool,
    peaks: MachinePeaks,
) -> tuple[list[Cell], dict[str, float]]:
    """Every variant on every workload's chat-templated prompts at batch 1, with MFU and MBU against `peaks`;
    also the seconds each variant took to load."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    longest = max(len(ids) for workload in prompts.values() for ids in workload)
    llms: dict[str, Any] = {}
    costs: dict[str, TokenCost] = {}
    loads: dict[str, float] = {}
    cells: list[Cell] = []
    try:
        for variant in variants:
            start = time.perf_counter()
            llm = llms[variant.name] = LLM.from_engine_args(_sized(variant, longest, max_tokens).engine_args)
            loads[variant.name] = time.perf_counter() - start
            # The target's weights alone: a draft model's reads are overhead, not the work being served.
            step_bytes = llm.loaded.step_weight_bytes()  # greedy, as every variant here decodes
            costs[variant.name] = TokenCost.of(llm.loaded.path, step_bytes, llm.engine.kv_bytes_per_token)
            _run_one(llm, llm.tokenizer.encode(WARM_UP), replace(params, max_tokens=8))  # kernels, allocations
        for name, workload in prompts.items():
            print(f"folio: [batch1] {name}: {len(workload)} requests x {len(variants)} variants",
                  file=sys.stderr, flush=True)  # fmt: skip
            cells += _run_workload(variants, llms, name, workload, params, costs, peaks)
    finally:
        llms.clear()
        gc.collect()
    return cells, loads


def _run_workload(variants: list[Variant], llms: dict[str, Any], workload: str, prompts: list[list[int]],
                  params: SamplingParams, costs: dict[str, TokenCost], peaks: MachinePeaks) -> list[Cell]:  # fmt: skip
    samples: dict[str, list[_Sample]] = {v.name: [] for v in variants}
    before = {v.name: from_engine(llms[v.name].engine.make_stats().spec_decoding) for v in variants}
    for i, prompt_ids in enumerate(prompts):
        for j in range(len(variants)):  # rotated: each variant goes first as often as the others
            variant = variants[(i + j) % len(variants)]
            samples[variant.name].append(_run_one(llms[variant.name], prompt_ids, params))
    cells = []
    for variant in variants:
        spec = from_engine(llms[variant.name].engine.make_stats().spec_decoding).since(before[variant.name])
        mine, theirs = samples[variant.name], samples[variant.baseline]
        matches = sum(a.output_ids == b.output_ids for a, b in zip(mine, theirs, strict=True))
        lengths = [(s.prompt_len, len(s.output_ids)) for s in mine]
        utilisation = batch1_utilisation(lengths, sum(s.e2e_s for s in mine), costs[variant.name], peaks)
        matched = None if variant.baseline == variant.name else matches
        cells.append(_cell(variant, workload, mine, spec, matched, utilisation))
    return cells
