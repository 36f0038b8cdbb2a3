"""The command line reads a subcommand's positionals wherever its flags sit, as the README's tour writes
them (`folio run MODEL --raw PROMPT --temperature 0`)."""

from __future__ import annotations

import pytest

from folio.cli import main, parse
from folio.cli import parser as cli_parser


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


class _BrokenEntry:
    """An entry point whose distribution is listed but whose package cannot be imported."""

    def load(self):
        raise ModuleNotFoundError("No module named 'folio_tools'")


@pytest.mark.parametrize("entries", [[], [_BrokenEntry()]], ids=["not-installed", "not-importable"])
@pytest.mark.parametrize("words", [["bench", "decode", "m", "--rounds", "3"], ["kv-calc", "m"], ["eval", "--help"]])
def test_a_tool_command_without_the_tools_says_how_to_install_them(monkeypatch, capsys, entries, words):
    monkeypatch.setattr(cli_parser, "entry_points", lambda group: entries)
    assert main(words) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"`folio {words[0]}` is one of folio's tools" in err
    assert "pip install -e ./tools" in err
    if entries:
        assert "No module named 'folio_tools'" in err


def test_the_runtime_commands_work_without_the_tools(monkeypatch):
    monkeypatch.setattr(cli_parser, "entry_points", lambda group: [])
    args = parse(["serve", "m", "--port", "9"])
    assert (args.command, args.port) == ("serve", 9)
