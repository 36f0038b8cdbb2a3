"""`folio bench serve-compare` with a second folio server standing in for llama-server (the peer registry
takes any launcher): both servers started as subprocesses one after the other, the combined JSON and its
ratios, the table, the plots, and every server stopped afterwards, also when the peer fails to start, the
port is taken, or the run is interrupted. llama.cpp itself is not needed."""

from __future__ import annotations

import json
import socket
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import replace

import pytest
from folio_tools.bench.harness.datasets import LengthRange
from folio_tools.bench.serve.command import RateResult, ServeConfig
from folio_tools.bench.serve_compare import command as serve_compare
from folio_tools.bench.serve_compare.command import (
    PEERS,
    CompareConfig,
    CompareReport,
    ServerRun,
    ServerSpec,
    folio_spec,
)
from folio_tools.bench.serve_compare.peers import default_ctx_size
from folio_tools.bench.serve_compare.report import format_table, plotted_rate_index, ratios

from folio.cli import build_parser, main
from tests.tiny_models import make_tiny_chat_model
from tests.utilisation import plausible

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytestmark = pytest.mark.usefixtures("peaks_measured_once")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("compare") / "llama")


@pytest.fixture
def started(monkeypatch, tmp_path):
    """Every server process the benchmark starts; logs go to a temporary folder of this test's own."""
    processes = []
    real_start = serve_compare.start_process

    def start(argv, log_path):
        processes.append(real_start(argv, log_path))
        return processes[-1]

    monkeypatch.setattr(serve_compare, "start_process", start)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return processes


def _twin(config: CompareConfig) -> ServerSpec:
    """A second `folio serve` as the peer, with an extra body folio accepts."""
    return replace(folio_spec(config), name="twin", extra_body={"top_k": 1}, info={"stand-in": True})


def _refused(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _argv(tiny_llama, out_dir, *extra: str) -> list[str]:
    return ["bench", "serve-compare", str(tiny_llama), "--num-prompts", "6", "--input-len-range", "4:24",
            "--output-len-range", "2:8", "--seed", "3", "--kv-cache-memory", "16MiB", "--output-dir", str(out_dir),
            *extra]  # fmt: skip


def test_folio_against_a_stand_in_peer(tiny_llama, tmp_path, capsys, monkeypatch, started):
    monkeypatch.setitem(PEERS, "twin", _twin)
    out_dir = tmp_path / "results"
    argv = _argv(tiny_llama, out_dir, "--peer", "twin", "--request-rate", "inf", "20", "--slo", "ttft=10s",
                 "--price-per-hour", "1.5", "--max-num-seqs", "8")  # fmt: skip
    assert main(argv) == 0

    # One server at a time, both stopped and their ports closed; the logs' folder removed.
    assert len(started) == 2 and all(p.poll() is not None for p in started)
    assert not list((tmp_path / "tmp").iterdir())
    [json_path] = out_dir.glob("*.json")
    assert json_path.stem.startswith("serve-compare-llama-")
    for suffix in ("latency", "rates"):
        assert (out_dir / f"{json_path.stem}-{suffix}.png").read_bytes().startswith(b"\x89PNG")

    report = json.loads(json_path.read_text())
    assert report["benchmark"] == "serve-compare" and report["peer"] == "twin"
    assert report["command"].startswith(f"folio bench serve-compare {tiny_llama} --peer twin ")
    assert "--request-rate inf 20" in report["command"] and "--max-num-seqs 8" in report["command"]
    assert report["machine"]["cores"] >= 1 and report["date_utc"].endswith("Z")
    folio, twin = report["servers"]
    assert (folio["name"], twin["name"]) == ("folio", "twin") and twin["info"] == {"stand-in": True}
    ports = []
    for server in (folio, twin):
        words = server["command"].split()
        assert words[:5] == [sys.executable, "-m", "folio.cli", "serve", str(tiny_llama)]
        assert "--kv-cache-memory 16MiB" in server["command"] and "--max-queue 6" in server["command"]
        ports.append(int(words[words.index("--port") + 1]))
    assert all(_refused(port) for port in ports)
    assert folio["result"]["settings"]["extra_body"] == {} and twin["result"]["settings"]["extra_body"] == {"top_k": 1}

    # The same workload to both, every request answered in full.
    for server in (folio, twin):
        assert [r["request_rate"] for r in server["result"]["results"]] == ["inf", "20"]
        for result in server["result"]["results"]:
            assert result["completed"] == 6 and result["failed"] == 0
            assert [r["output_tokens"] for r in result["requests"]] == [r["output_len"] for r in result["requests"]]
    shape = [[(r["prompt_len"], r["output_len"]) for r in res["requests"]] for res in folio["result"]["results"]]
    assert shape == [[(r["prompt_len"], r["output_len"]) for r in res["requests"]] for res in twin["result"]["results"]]

    # Ratios are folio / twin of the two results, metric by metric.
    where = {"mean_ttft_ms": ("ttft_ms", "mean"), "p99_e2e_ms": ("e2e_ms", "p99"), "mean_itl_ms": ("itl_ms", "mean"),
             "requests_per_s": ("requests_per_s",), "goodput_requests_per_s": ("goodput_requests_per_s",),
             "cost_per_1m_output_tokens": ("cost_per_1m_output_tokens",), "mfu": ("mfu",)}  # fmt: skip
    for row, ours, theirs in zip(report["ratios"], folio["result"]["results"], twin["result"]["results"], strict=True):
        assert row["request_rate"] == ours["request_rate"]
        # goodput and cost included (--slo and --price-per-hour were given), MFU, and both servers' prefix hit rates
        assert len(row["metrics"]) == 13
        for key, path in where.items():
            a, b = ours, theirs
            for part in path:
                a, b = a[part], b[part]
            metric = row["metrics"][key]
            assert (metric["folio"], metric["twin"]) == (a, b)
            assert metric["ratio"] == pytest.approx(a / b)
        assert row["metrics"]["requests_per_s"]["better"] == "higher"
        assert row["metrics"]["p99_e2e_ms"]["better"] == "lower"
        assert plausible(row["metrics"]["mfu"]["folio"]) and row["metrics"]["mfu"]["better"] == "higher"

    printed = capsys.readouterr().out
    assert printed.startswith(f"folio vs twin: {tiny_llama}, random, 6 requests, seed 3")
    assert "rate inf req/s" in printed and "rate 20 req/s" in printed and "folio/twin" in printed
    for label in ("requests/s", "output tok/s", "p50 TTFT ms", "p99 TPOT ms", "p99 E2E ms", "goodput req/s",
                  "$/1M output tok", "MFU %"):  # fmt: skip
        assert label in printed
    assert f"twin: {twin['command']}" in printed and str(json_path) in printed


def _one_error_line(capsys) -> str:
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("folio: error:")]
    assert len(errors) == 1, errors
    return errors[0]


def test_a_peer_that_fails_to_start_gives_one_line_and_folio_is_stopped(
    tiny_llama, tmp_path, capsys, monkeypatch, started
):
    script = "import sys; print('loading the model'); print('error: no such file: model.gguf'); sys.exit(3)"
    monkeypatch.setitem(PEERS, "broken", lambda config: ServerSpec("broken", lambda port: [sys.executable, "-c",
                                                                                            script]))  # fmt: skip
    assert main(_argv(tiny_llama, tmp_path / "out", "--peer", "broken", "--num-prompts", "2")) == 1
    error = _one_error_line(capsys)
    assert error.startswith(
        "folio: error: the broken server exited with code 3 before it was ready: error: no such file: model.gguf"
    )
    assert len(started) == 2 and all(p.poll() is not None for p in started)  # folio ran, then was stopped
    [log_dir] = (tmp_path / "tmp").iterdir()  # kept, and named in the error
    assert str(log_dir / "broken.log") in error and "loading the model" in (log_dir / "broken.log").read_text()
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_a_taken_port_gives_one_line(tiny_llama, tmp_path, capsys, monkeypatch, started):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused, binding fails
        monkeypatch.setattr(serve_compare, "free_port", lambda: squatter.getsockname()[1])
        monkeypatch.setitem(PEERS, "twin", _twin)
        assert main(_argv(tiny_llama, tmp_path / "out", "--peer", "twin")) == 1
    error = _one_error_line(capsys)
    assert error.startswith("folio: error: the folio server exited with code 1 before it was ready")
    assert "address already in use" in error.lower()
    assert len(started) == 1 and started[0].poll() is not None


def test_interrupted_run_stops_the_server(tiny_llama, tmp_path, monkeypatch, started):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setitem(PEERS, "twin", _twin)
    monkeypatch.setattr(serve_compare, "run_serve", interrupt)
    assert main(_argv(tiny_llama, tmp_path / "out", "--peer", "twin")) == 130
    assert len(started) == 1 and started[0].poll() is not None


def test_peer_problems_fail_before_any_server_starts(tiny_llama, tmp_path, capsys, started):
    # llama.cpp needs a GGUF file; the tiny model is a Hugging Face folder. No build is looked for.
    assert main(_argv(tiny_llama, tmp_path / "out", "--peer", "llama.cpp")) == 1
    assert _one_error_line(capsys) == f"folio: error: --peer llama.cpp needs a GGUF model, and {tiny_llama} is " \
                                      f"{tiny_llama}"  # fmt: skip
    assert main(_argv(tiny_llama, tmp_path / "out", "--peer", "vllm")) == 1
    assert _one_error_line(capsys) == (
        "folio: error: unknown --peer 'vllm'; choose from folio-disaggregated, folio-dynamic, folio-engine-process, "
        "folio-no-kv-tiers, folio-no-prefix-cache, folio-ray-1, folio-replicas, folio-replicas-round-robin, "
        "folio-static, llama.cpp, llama.cpp-cache-ram"
    )
    assert main(_argv(tiny_llama, tmp_path / "out", "--llama-extra-body", '{"stream": false}')) == 1
    assert "--llama-extra-body must not set stream" in _one_error_line(capsys)
    assert started == []


def test_no_llama_cpp_build_and_no_cmake_gives_one_line(tiny_llama, tmp_path, capsys, monkeypatch, started):
    from folio_tools.bench.peers import llama_cpp_build

    monkeypatch.setenv("FOLIO_HOME", str(tmp_path / "home"))  # no build installed there
    real_which = llama_cpp_build.shutil.which
    monkeypatch.setattr(llama_cpp_build.shutil, "which", lambda name: None if name == "cmake" else real_which(name))
    monkeypatch.setattr(llama_cpp_build, "_download_sdist", lambda *a: pytest.fail("must not build llama.cpp"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # never opened: the missing build is found first
    assert main(["bench", "serve-compare", str(gguf), "--output-dir", str(tmp_path / "out")]) == 1
    assert _one_error_line(capsys).startswith("folio: error: building llama.cpp needs cmake")
    assert started == []


# -- by hand ------------------------------------------------------------------------------------------


def test_default_context_fits_the_longest_request_in_every_slot():
    assert default_ctx_size(16, 32, 16) == 16 * 256  # 32 + 16 + 64 = 112 -> 256 a slot
    assert default_ctx_size(4, 512, 256) == 4 * 1024  # 832 -> 1024
    assert default_ctx_size(1, 192, 0) == 256  # exactly 256 stays 256


def test_replica_peers_serve_two_replicas_and_wait_for_their_metrics(monkeypatch):
    workload = ServeConfig("http://x", "m", LengthRange(1, 2), LengthRange(1, 2))
    config = CompareConfig("m", workload, peer="folio-replicas")
    folio = folio_spec(config).argv(8123)
    replicas = ["--cpus-per-replica", "1", "--replicas", "2"]
    cache_aware, round_robin = PEERS["folio-replicas"](config), PEERS["folio-replicas-round-robin"](config)
    assert cache_aware.argv(8123) == [*folio, *replicas]  # cache_aware is folio serve's default routing
    assert round_robin.argv(8123) == [*folio, *replicas, "--routing", "round_robin"]
    for spec, routing in ((cache_aware, "cache_aware"), (round_robin, "round_robin")):
        assert spec.info["replicas"] == 2 and spec.info["routing"] == routing and spec.metrics_lag_s == 2.5
        args = build_parser().parse_args(spec.argv(8123)[3:])  # after `python -m folio.cli`
        assert (args.replicas, args.cpus_per_replica, args.routing, args.port) == (2, 1.0, routing, 8123)
    assert (cache_aware.name, round_robin.name) == ("folio-replicas", "folio-replicas-round-robin")
    disaggregated = PEERS["folio-disaggregated"](config).argv(8123)
    assert disaggregated == [*folio, "--cpus-per-replica", "1", "--disaggregate", "--prefill-replicas", "1",
                             "--replicas", "1"]  # fmt: skip
    args = build_parser().parse_args(disaggregated[3:])
    assert (args.disaggregate, args.prefill_replicas, args.replicas) == (True, 1, 1)

    # run_compare hands each server's lag to its run: none for folio, 2.5 s for the replicas.
    @contextmanager
    def fake_server(spec, log_path, timeout):
        yield f"http://{spec.name}", "line"

    lags = {}

    def fake_run_serve(workload, command, label):
        lags[label] = (workload.base_url, workload.metrics_lag_s)
        return None

    monkeypatch.setattr(serve_compare, "running_server", fake_server)
    monkeypatch.setattr(serve_compare, "run_serve", fake_run_serve)
    serve_compare.run_compare(config, "cmd")
    assert lags == {"folio": ("http://folio", 0.0), "folio-replicas": ("http://folio-replicas", 2.5)}


def test_plotted_rate_is_the_highest_finite_one():
    inf = float("inf")
    assert plotted_rate_index([inf]) == 0
    assert plotted_rate_index([1.0, inf, 4.0, 2.0]) == 2


def _result(rate: float, **summary) -> RateResult:
    base = {"completed": 2, "num_requests": 2, "ttft_ms": None, "tpot_ms": None, "itl_ms": None, "e2e_ms": None}
    return RateResult(rate, base | summary, [])


def test_ratios_and_table_by_hand():
    config = CompareConfig("m", ServeConfig("http://x", "m", LengthRange(1, 2), LengthRange(1, 2), request_rates=[2.0]))

    def run(name: str, result: RateResult) -> ServerRun:
        return ServerRun(name, f"{name} --serve", {}, type("R", (), {"results": [result]})())  # a ServeReport stand-in

    ours = _result(2.0, requests_per_s=3.0, output_tokens_per_s=30.0, ttft_ms={"mean": 50.0, "p50": 40.0, "p99": 90.0})
    theirs = _result(2.0, requests_per_s=1.5, output_tokens_per_s=0.0, ttft_ms={"mean": 100.0, "p50": 40.0})
    report = CompareReport("cmd", "2025-01-31T12:00:00Z", config, {"cpu": "x", "cores": 2},
                           [run("folio", ours), run("llama.cpp", theirs)])  # fmt: skip
    [row] = ratios(report)
    metrics = row["metrics"]
    assert row["request_rate"] == "2" and len(metrics) == 9  # no goodput without --slo, no cost without a price
    assert metrics["requests_per_s"] == {"folio": 3.0, "llama.cpp": 1.5, "ratio": 2.0, "better": "higher"}
    assert metrics["mean_ttft_ms"]["ratio"] == 0.5 and metrics["p50_ttft_ms"]["ratio"] == 1.0
    assert metrics["output_tokens_per_s"]["ratio"] is None  # nothing to divide by
    assert metrics["p99_ttft_ms"]["ratio"] is None and metrics["mean_tpot_ms"]["folio"] is None  # missing values
    table = format_table(report)
    assert "requests/s                  3.00        1.50            2.00x  higher" in table
    assert "mean TTFT ms               50.00      100.00            0.50x  lower" in table
    assert "p99 TTFT ms                90.00           -                -  lower" in table
    assert "llama.cpp: llama.cpp --serve" in table and "MFU" not in table  # neither measured it

    ours.summary["mfu"], theirs.summary["mfu"] = 0.125, 0.0625  # a fraction in the JSON, a percentage shown
    assert ratios(report)[0]["metrics"]["mfu"] == {
        "folio": 0.125,
        "llama.cpp": 0.0625,
        "ratio": 2.0,
        "better": "higher",
    }
    assert "MFU %                      12.50        6.25            2.00x  higher" in format_table(report)
