"""A benchmark's recorded command line runs the same benchmark again: parsed back, it gives the same
arguments, the engine's switches included."""

from __future__ import annotations

import shlex

import pytest
from folio_tools.bench.harness.flags import command_line

from folio.cli import build_parser


@pytest.mark.parametrize(
    "words",
    [
        ["bench", "decode", "m", "--compile", "--enforce-eager", "--no-prefix-caching"],
        ["bench", "decode", "m", "--device", "cuda", "--dtype", "bfloat16", "--prompt-tokens", "128", "2048"],
        ["bench", "profile", "m", "--batch", "64", "--no-hybrid-kv-cache"],
        ["bench", "profile", "m", "--prefill", "--prompt-tokens", "512"],
    ],
)
def test_the_recorded_command_parses_back_to_the_same_arguments(words):
    parser = build_parser()
    args = parser.parse_args(words)
    recorded = shlex.split(command_line(args))
    assert recorded[0] == "folio"
    again = parser.parse_args(recorded[1:])
    assert {k: v for k, v in vars(again).items() if not callable(v)} == {
        k: v for k, v in vars(args).items() if not callable(v)
    }
