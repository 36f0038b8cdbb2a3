"""`folio bench restart` end to end on a tiny model, folio only: two `folio serve` processes on one
--kv-cache-dir, the second answering the first's prompt from disk."""

from __future__ import annotations

import json

import pytest

from folio.cli import main
from tests.tiny_models import make_tiny_chat_model

pytest.importorskip("matplotlib")


def test_a_restarted_server_reads_the_prompt_it_saw_from_disk(tmp_path, capsys):
    model = make_tiny_chat_model(tmp_path / "llama")
    code = main(["bench", "restart", str(model), "--no-peer", "--rounds", "1", "--prompt-len", "256",
                 "--output-dir", str(tmp_path / "out")])  # fmt: skip
    assert code == 0
    [json_path] = (tmp_path / "out").glob("restart_*.json")
    result = json.loads(json_path.read_text())
    times = result["seconds_to_first_token"]["folio"]
    assert all(len(times[case]) == 1 and times[case][0] > 0 for case in ("cold", "in_memory", "restarted"))
    assert result["summary"]["folio_cold_over_restarted"] > 0 and "llama.cpp" not in result["summary"]
    assert "--kv-cache-dir" in result["commands"]["folio"]
    assert "folio cold / restarted" in capsys.readouterr().out
    assert list((tmp_path / "out").glob("restart_*.png"))


def test_the_cache_directory_is_the_benchmarks_own(tmp_path, capsys):
    assert main(["bench", "restart", "x", "--no-peer", "--kv-cache-dir", str(tmp_path)]) == 1
    assert "--kv-cache-dir is the benchmark's own" in capsys.readouterr().err
