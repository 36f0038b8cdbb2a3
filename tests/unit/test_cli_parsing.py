"""The command line reads a subcommand's positionals wherever its flags sit, as the README's tour writes
them (`folio run MODEL --raw PROMPT --temperature 0`)."""

from __future__ import annotations

import pytest

from folio.cli import parse


def test_positionals_between_flags():
    args = parse(["run", "gemma3-270m", "--raw", "The capital of France is", "--temperature", "0"])
    assert (args.model, args.prompt, args.raw, args.temperature) == ("gemma3-270m", "The capital of France is", True, 0)
    assert parse(["run", "just a prompt"]).prompt == "just a prompt"  # the model is optional


def test_speculative_flags_reach_the_engine_args():
    args = parse(["serve", "m", "--speculative-method", "ngram", "--num-speculative-tokens", "3"])
    assert (args.speculative_method, args.num_speculative_tokens) == ("ngram", 3)


def test_unknown_flags_are_still_refused(capsys):
    with pytest.raises(SystemExit):
        parse(["run", "m", "hello", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["bench", "decode", "m", "--bogus"])
