"""Batch-1 rates measured in alternating rounds (folio_tools/bench/harness/paired_rounds.py) and how `folio bench
decode` reports them beside llama-bench's tg."""

from __future__ import annotations

import pytest
from folio_tools.bench.decode import DecodeReport, VariantResult, format_table
from folio_tools.bench.harness.paired_rounds import alternate

from folio.cli import main


def test_rounds_alternate_and_the_median_ratio_compares_them():
    calls: list[str] = []
    firsts, seconds = iter([100.0, 80.0, 120.0]), iter([50.0, 80.0, 100.0])

    def first() -> float:
        calls.append("first")
        return next(firsts)

    def second() -> float:
        calls.append("second")
        return next(seconds)

    paired = alternate(first, second, 3)
    assert calls == ["first", "second"] * 3  # each round's two figures share the machine's state
    assert paired.ratios == [2.0, 1.0, 1.2]
    assert paired.median_ratio == 1.2
    assert paired.to_dict() == {"first": [100.0, 80.0, 120.0], "second": [50.0, 80.0, 100.0],
                                "ratios": [2.0, 1.0, 1.2], "median_ratio": 1.2}  # fmt: skip
    with pytest.raises(ValueError, match="at least 1"):
        alternate(first, second, 0)


def test_the_decode_table_reports_the_paired_rounds():
    folio = VariantResult("folio gguf", 92.0, 110.0, 700.0)
    peer = VariantResult("llama.cpp", None, 80.0, 230.0)
    paired = alternate(iter([100.0, 90.0, 130.0]).__next__, iter([80.0, 90.0, 100.0]).__next__, 3)
    report = DecodeReport("folio bench decode smollm2-135m --peer llama.cpp", "2026-11-27T12:00:00Z",
                          "smollm2-135m", "float32", {"batch": 64, "gen_tokens": 128, "prompt_tokens": []},
                          [folio, peer], {"paired_batch1": {"folio": "gguf", **paired.to_dict()}})  # fmt: skip
    table = format_table(report)
    assert "batch-1: folio gguf / llama.cpp tg128 = 1.38x" in table
    assert "batch-1, 3 rounds alternating folio gguf and llama-bench's tg128: median 1.25x (rounds 1.00-1.30x)" in table


def test_a_negative_round_count_is_one_line(capsys):
    assert main(["bench", "decode", "smollm2-135m", "--paired-rounds", "-1"]) != 0
    err = capsys.readouterr().err
    assert "--paired-rounds must be 0 or more, got -1" in err and "Traceback" not in err
