"""The pure pieces of `folio bench spec`, by hand: its workloads, the variants it builds from the command
line, the spec-decode counters it reads (/metrics text, llama-server timings), the speedups, the bars and
the table. The benchmark end to end is tests/e2e/test_bench_spec.py."""

from __future__ import annotations

import pytest
from folio_tools.bench.harness.datasets import LengthRange
from folio_tools.bench.harness.roofline import MachinePeaks, TokenCost
from folio_tools.bench.spec.command import build_variants, check_methods
from folio_tools.bench.spec.counters import SpecCounts, from_engine, from_llama_timings, parse_metrics
from folio_tools.bench.spec.offline import batch1_utilisation, kv_blocks_for
from folio_tools.bench.spec.peer import check_flags, peer_variants
from folio_tools.bench.spec.plot import speedup_groups
from folio_tools.bench.spec.report import add_speedups, bars, format_markdown, format_table, to_dict
from folio_tools.bench.spec.values import Cell, SpecConfig, SpecReport
from folio_tools.bench.spec.workloads import build_workload, camel_case, code_edit_prompts, rewrite_prompts

from folio.cli import parse
from folio.config import SpeculativeConfig
from folio.spec_decode.scheduling import SpecDecodeStats

# -- workloads ---------------------------------------------------------------------------------------------


def test_camel_case_renames_and_a_plain_name_gets_a_suffix():
    assert camel_case("has_close_elements") == "hasCloseElements"
    assert camel_case("fib") == "fib_impl"


def test_code_edit_prompts_hold_the_whole_code_and_take_the_edits_in_turn():
    problems = [
        {"entry_point": "add_two", "prompt": "def add_two(x):\n", "canonical_solution": "    return x + 2\n"},
        {"entry_point": "neg", "prompt": "def neg(x):\n", "canonical_solution": "    return -x\n"},
    ]
    first, second = code_edit_prompts(problems)
    assert first.startswith("Rename the function `add_two` to `addTwo`")
    assert first.endswith("```python\ndef add_two(x):\n    return x + 2\n```")
    assert second.startswith("Add type hints") and "def neg(x):\n    return -x" in second


def test_rewrite_prompts_keep_requests_to_rework_a_text():
    prompts = ["Please summarize this article: ...", "What is the capital of France?", "rewrite my email: hi",
               "Can you correct the grammar? correct this text: ..."]  # fmt: skip
    assert rewrite_prompts(prompts) == [prompts[0], prompts[2], prompts[3]]
    with pytest.raises(ValueError, match="no ShareGPT first turn"):
        rewrite_prompts(["hello"])


def test_grounded_workload_is_seeded_length_filtered_and_asks_max_tokens():
    encode = lambda text: text.split()  # noqa: E731 - words as tokens
    requests = build_workload("grounded", encode, 5, LengthRange(10, 120), 64, seed=3)
    assert len(requests) == 5 and all(r.output_len == 64 for r in requests)
    assert all(10 <= r.prompt_len <= 120 and r.prompt_len == len(r.prompt.split()) for r in requests)
    assert all("```python\n" in r.prompt for r in requests)
    assert build_workload("grounded", encode, 5, LengthRange(10, 120), 64, seed=3) == requests
    assert build_workload("grounded", encode, 5, LengthRange(10, 120), 64, seed=4) != requests
    with pytest.raises(ValueError, match="workload grounded: no chat prompt is 1:2 tokens long"):
        build_workload("grounded", encode, 5, LengthRange(1, 2), 64, seed=3)


# -- variants from the command line ------------------------------------------------------------------------


def _args(*extra: str):
    return parse(["bench", "spec", "m.gguf", *extra])


def test_each_method_gets_its_flags_and_the_draft_its_dense_target_alone_as_baseline():
    args = _args("--methods", "none", "ngram", "draft", "--draft-model", "d.gguf", "--num-speculative-tokens", "3")
    none, ngram, dense, draft = build_variants(args)
    assert [(v.name, v.method, v.baseline) for v in (none, ngram, dense, draft)] == [
        ("none", "none", "none"), ("ngram", "ngram", "none"), ("none-dense", "none", "none-dense"),
        ("draft", "draft", "none-dense"),
    ]  # fmt: skip
    assert none.engine_args.speculative_config is None and none.engine_args.quantization is None
    assert ngram.engine_args.speculative_config.method == "ngram"
    assert ngram.engine_args.speculative_config.num_speculative_tokens == 3
    assert ngram.engine_args.speculative_config.draft_model is None
    assert dense.engine_args.quantization == "none" and dense.engine_args.speculative_config is None
    assert draft.engine_args.quantization == "none" and draft.engine_args.speculative_config.draft_model == "d.gguf"
    flags = draft.to_dict()["flags"]
    assert flags[flags.index("--speculative-method") + 1] == "draft" and "--draft-model" in flags


def test_a_draft_on_the_runs_own_quantization_is_measured_against_none():
    for extra in (("--quantization", "none"), ("--draft-target-quantization", "keep")):
        variants = build_variants(_args("--methods", "none", "draft", "--draft-model", "d", *extra))
        assert [(v.name, v.baseline) for v in variants] == [("none", "none"), ("draft", "none")]


def test_methods_are_checked_in_one_line():
    check_methods(["none", "ngram"], None)
    with pytest.raises(ValueError, match=r"^--methods: unknown speculative method 'bogus'; this folio has none, "):
        check_methods(["none", "bogus"], None)
    with pytest.raises(ValueError, match="twice"):
        check_methods(["none", "ngram", "ngram"], None)
    with pytest.raises(ValueError, match="must include none"):
        check_methods(["ngram"], None)
    with pytest.raises(ValueError, match="needs --draft-model"):
        check_methods(["none", "draft"], None)


def test_offline_kv_pool_fits_one_request_and_its_drafts():
    assert kv_blocks_for(longest_prompt=100, max_tokens=20, num_drafts=4, block_size=16) == 8 + 2  # 125 -> 8


# -- counters --------------------------------------------------------------------------------------------

METRICS = """# HELP folio:spec_decode_num_drafts Verifications.
# TYPE folio:spec_decode_num_drafts counter
folio:spec_decode_num_drafts_total{model_name="m"} 10.0
folio:spec_decode_num_draft_tokens_total{model_name="m"} 40.0
folio:spec_decode_num_accepted_tokens_total{model_name="m"} 25.0
folio:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 9.0
folio:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 7.0
folio:prefix_cache_hits_total{model_name="m"} 3.0
"""


def test_metrics_counters_and_their_difference():
    after = parse_metrics(METRICS)
    assert after == SpecCounts(10, 40, 25, "/metrics", (9, 7))
    run = after.since(SpecCounts(2, 8, 5, "/metrics", (3,)))
    assert (run.num_drafts, run.num_draft_tokens, run.num_accepted_tokens) == (8, 32, 20)
    assert run.accepted_per_position == (6, 7)
    assert run.acceptance_rate == 20 / 32 and run.mean_accepted_length == 1 + 20 / 8
    assert parse_metrics("folio:prefix_cache_hits_total 3\n") is None  # no speculative counters there


def test_engine_counters_and_llama_timings():
    stats = SpecDecodeStats()
    stats.record(4, 3)
    stats.record(2, 0)
    counts = from_engine(stats)
    assert counts.to_dict() == {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 3, "source": "engine",
                                "accepted_per_position": (1, 1, 1, 0),
                                "acceptance_rate": 0.5, "mean_accepted_length": 2.5}  # fmt: skip
    llama = from_llama_timings([{"draft_n": 6, "draft_n_accepted": 4}, {"predicted_n": 3}, None, {"draft_n": 2}])
    assert (llama.num_drafts, llama.num_draft_tokens, llama.num_accepted_tokens) == (None, 8, 4)
    assert llama.acceptance_rate == 0.5 and llama.mean_accepted_length is None
    assert SpecCounts(0, 0, 0, "engine").acceptance_rate is None


# -- llama-server's configurations -------------------------------------------------------------------------


def test_llama_server_configurations_follow_folios_settings():
    config = SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_max=3)
    none, ngram = peer_variants(config, None, "--spec-draft-n-min 1")
    assert none.args == ()
    assert ngram.args == ("--spec-type", "ngram-simple", "--spec-draft-n-max", "5", "--spec-ngram-simple-size-n", "3",
                          "--spec-ngram-simple-size-m", "5", "--spec-draft-n-min", "1")  # fmt: skip
    help_text = "--spec-type none,ngram-simple\n--spec-draft-n-max N  drafts\n--spec-ngram-simple-size-n N\n"
    with pytest.raises(ValueError, match=r"llama-cpp-python 9\.9 has no --spec-ngram-simple-size-m \(for ngram\)"):
        check_flags(help_text, [none, ngram], "9.9")
    check_flags(help_text + "--spec-ngram-simple-size-m N\n--spec-draft-n-min N\n", [none, ngram], "9.9")


# -- utilisation --------------------------------------------------------------------------------------------


def test_batch1_utilisation_by_hand():
    # 1000 multiplied parameters (100 of them the LM head), 2 layers x 4 query dims, 5000 weight bytes, 8 KV
    # bytes a token; peaks of 1000 FLOP/s and 1000 B/s.
    cost = TokenCost(1000, 2, 4, 5000, 8, head_params=100)
    peaks = MachinePeaks("float32", 1e-6, 1e-6)
    # Request (3 prompt, 2 output): prefill 2000x3 + 16x3x4 - 200x2 = 5792, then one decoded token attending to
    # 4: 2000 + 32x4 = 2128. Request (5, 4): 10000 + 16x5x6 - 200x4 = 9680, then 3 tokens attending to 6, 7, 8:
    # 6000 + 32x21 = 6672. Over 2 s: 24272 / 2 / 1000 FLOP/s.
    got = batch1_utilisation([(3, 2), (5, 4)], 2.0, cost, peaks)
    assert got["mfu"] == pytest.approx(24272 / 2 / 1000)
    # 6 output tokens in 2 s, attending on average to (3 + 4 + 5 + 6 + 7 + 8) / 6 = 5.5 tokens: each reads the
    # 5000 weight bytes and 5.5 x 8 KV bytes.
    assert got["mbu"] == pytest.approx(3 * (5000 + 5.5 * 8) / 1000)
    assert batch1_utilisation([(3, 0)], 2.0, cost, peaks) == {"mfu": None, "mbu": None}
    assert batch1_utilisation([(3, 2)], 0.0, cost, peaks) == {"mfu": None, "mbu": None}


# -- speedups, bars, table ---------------------------------------------------------------------------------


def _cell(variant: str, setting: str, tokens: int, workload: str = "grounded", baseline: str = "none",
          tpot: float = 5.0, mfu: float | None = None, mbu: float | None = None) -> Cell:  # fmt: skip
    method = "none" if variant.startswith("none") else variant
    spec = None if method == "none" else SpecCounts(4, 16, 12, "engine")
    return Cell("folio", variant, method, baseline, workload, setting, 1, 2, 2, tokens, 1.0, {"mean": tpot, "p50": 4.0},
                {"p50": 30.0}, spec, mfu=mfu, mbu=mbu)  # fmt: skip


def _report(cells: list[Cell]) -> SpecReport:
    args = _args("--methods", "none", "ngram", "draft", "--draft-model", "d")
    config = SpecConfig("m.gguf", build_variants(args), ["grounded", "chat"], concurrency=[1, 16], peer="none")
    add_speedups(cells)
    return SpecReport("folio bench spec m.gguf", "2025-01-31T12:00:00Z", config, {"cpu": "x", "cores": 2}, cells, [],
                      {}, {"dtype": "float32", "matmul_gflops": 140.0, "read_gbps": 31.0})  # fmt: skip


def test_speedups_bars_and_table():
    cells = [
        _cell("none", "batch1", 100, mfu=0.004, mbu=0.6), _cell("ngram", "batch1", 250, tpot=2.0, mfu=0.01, mbu=1.5),
        _cell("none-dense", "batch1", 40, baseline="none-dense"), _cell("draft", "batch1", 60, baseline="none-dense"),
        _cell("none", "c16", 100, "chat", mfu=0.25), _cell("ngram", "c16", 94, "chat"),
        _cell("ngram", "c1", 90, "chat"),
    ]  # fmt: skip
    report = _report(cells)
    assert [c.speedup for c in cells] == [1.0, 2.5, 1.0, 1.5, 1.0, 0.94, None]  # ngram c1 chat: no baseline there
    assert [c.decode_speedup for c in cells] == [1.0, 2.5, 1.0, 1.0, 1.0, 1.0, None]
    verdicts = {b["bar"]: (b["passed"], b["speedup"]) for b in bars(report)}
    assert verdicts == {
        "ngram >= 2x none at batch 1 on grounded": (True, 2.5),
        "ngram >= 0.95x none on chat at concurrency 16": (False, 0.94),
        "draft >= 2x none-dense (its target alone) at batch 1 on grounded": (False, 1.5),
        "draft >= 2x none-dense (its target alone) at batch 1 on chat": (None, None),
        "draft >= 0.95x none-dense on chat at concurrency 16": (None, None),
    }
    table = format_table(report)
    ngram_row = (
        "batch1 ngram" + " " * 21 + "250.00      2.00     4.00        -    30.00    0.75    4.00   2.50x   2.50x      -"
        "    1.0  150.0"  # MFU %, MBU %: a speculative MBU passes 100%
    )
    assert ngram_row in table
    assert table.splitlines()[3].endswith("   same  MFU %  MBU %")
    assert "c16    none" + " " * 22 + "100.00" in table and table.count("   25.0      -") == 1  # served: no MBU
    assert "peaks measured at the start: 140 GFLOP/s (float32 GEMM), 31.0 GB/s read" in table
    assert "PASS  ngram >= 2x none at batch 1 on grounded: 2.50x (decoding alone 2.50x)" in table
    assert "FAIL  ngram >= 0.95x none on chat at concurrency 16: 0.94x (decoding alone 1.00x)" in table
    assert "n/a   draft >= 2x none-dense (its target alone) at batch 1 on chat: not measured" in table
    markdown = format_markdown(report)
    assert (
        "| batch1 | folio | ngram | 250.0 | 2.0 | 4.0 | - | 30.0 | 0.75 | 4.00 | **2.50x** | 2.50x | 1.0 | 150.0 |"
        in markdown
    )
    assert "| c16 | folio | none | 100.0 | 5.0 | 4.0 | - | 30.0 | - | - | **1.00x** | 1.00x | 25.0 | - |" in markdown
    data = to_dict(report)
    assert data["peaks"] == report.peaks and "mbu" in data["utilisation"]
    assert [(r["mfu"], r["mbu"]) for r in data["results"][:2]] == [(0.004, 0.6), (0.01, 1.5)]
    assert speedup_groups(cells) == (["batch1", "c16", "c1"], ["ngram", "draft"])
