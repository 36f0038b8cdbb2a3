"""The robustness benchmarks, short: schemathesis cases against a real server (only 2xx/4xx, the server
empty afterwards), ten times the server's capacity in clients for a few seconds (only 200/429), and both
commands end to end on a tiny model (server started and stopped, JSON and PNG written)."""

from __future__ import annotations

import json
import os

import pytest
from folio_tools.bench.harness.folio_server import resident_mib
from folio_tools.bench.robustness.fuzz import run_fuzz
from folio_tools.bench.robustness.hostile import SHAPES
from folio_tools.bench.robustness.overload import OverloadConfig, run_overload

from folio import LLM
from folio.cli import main
from folio.server.serve import ServerOptions
from tests.api.server_runner import MODEL, running_server
from tests.tiny_models import make_tiny_chat_model


def test_schemathesis_cases_get_only_2xx_and_4xx_and_leave_the_server_empty(smollm2_gguf):
    # A short context (`folio bench fuzz` takes 96) keeps the answers that do generate short.
    llm = LLM(smollm2_gguf, kv_cache_memory="64MiB", max_model_len=48)
    with running_server(llm, MODEL) as (url, _):
        # A seed whose 200 cases both reach the engine and are refused at every generation endpoint (checked
        # below): a chat completion that fits the schema often breaks a rule of folio's own.
        report = run_fuzz(url, num_cases=200, seed=11, hostile_share=0)
    assert report.failures == 0, report.samples
    assert report.final_state["settled"] and report.passed
    assert report.requests >= 100
    generation = [report.by_operation[f"POST {path}"] for path in ("/v1/completions", "/v1/chat/completions",
                                                                  "/api/chat", "/api/generate")]  # fmt: skip
    assert all("200" in statuses and "400" in statuses for statuses in generation)  # reached the engine, and not


def test_hostile_shapes_at_every_post_route_get_4xx_in_their_apis_format(smollm2_gguf):
    llm = LLM(smollm2_gguf, kv_cache_memory="64MiB", max_model_len=48)
    with running_server(llm, MODEL) as (url, _):
        report = run_fuzz(url, num_cases=42, seed=1, hostile_share=1.0)  # three a POST route
    assert report.failures == 0, report.samples
    assert report.passed and report.requests == 42
    assert set(report.by_shape) == set(SHAPES)
    refused = [statuses for shape, statuses in report.by_shape.items() if SHAPES[shape][1]]
    assert all(status.startswith("4") for statuses in refused for status in statuses)
    assert {"POST /api/chat", "POST /v1/messages", "POST /v1/responses"} <= set(report.by_operation)


def test_ten_times_the_capacity_gets_only_200_and_429(smollm2_gguf):
    llm = LLM(smollm2_gguf, kv_cache_memory="64MiB", max_num_seqs=2, max_model_len=256)
    with running_server(llm, MODEL, ServerOptions(max_queue=2)) as (url, _):
        config = OverloadConfig(MODEL, duration_s=3, concurrency=40, max_tokens=(2, 12))
        report = run_overload(config, url, lambda: resident_mib(os.getpid()))
    assert report.failures == 0, report.samples
    assert set(report.by_status) == {"200", "429"}
    assert report.final_state["settled"] and report.passed
    assert report.memory_mib and report.memory_summary() is not None


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("robust") / "llama")


def test_the_commands_start_a_server_and_write_their_results(tiny_chat_model, tmp_path, capsys):
    out = tmp_path / "results"
    assert main(["bench", "fuzz", str(tiny_chat_model), "--cases", "24", "--output-dir", str(out)]) == 0
    assert main(["bench", "overload", str(tiny_chat_model), "--duration", "2", "--max-queue", "1",
                 "--max-num-seqs", "1", "--output-dir", str(out)]) == 0  # fmt: skip
    assert main(["bench", "stall", str(tiny_chat_model), "--phase-seconds", "1.5", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("PASSED") == 2 and "/health latency" in printed
    stall = json.loads(next(out.glob("stall_*.json")).read_text())
    assert {a["status"] for a in stall["attacks"]} == {400} and len(stall["summary"]["attacks"]) >= 1
    assert stall["summary"]["health_ms"]["quiet"]["n"] > 0 and stall["summary"]["health_ms"]["attack"]["n"] > 0
    results = sorted(p for p in out.glob("*.json") if not p.name.startswith("stall"))
    assert [p.name.split("_")[0] for p in results] == ["fuzz", "overload"]
    assert all(p.with_suffix(".png").is_file() for p in results)
    fuzz, overload = (json.loads(p.read_text()) for p in results)
    assert fuzz["passed"] and fuzz["command"].startswith("folio bench fuzz") and fuzz["requests"] >= 10
    assert overload["passed"] and overload["config"]["concurrency"] == 20 and overload["server"]["capacity"] == 2
