"""`folio bench spec` end to end on a tiny random Llama: batch 1 in process and `folio serve` at two
concurrencies, without speculation, with prompt lookup and with a draft model (the target itself, so every
draft is accepted), on the grounded and chat workloads; the JSON, Markdown, PNG and the printed table.
llama-server is left out (`--peer none`): its build takes minutes; its flags are checked in
tests/unit/test_bench_spec.py."""

from __future__ import annotations

import json

import pytest

from folio.cli import main
from tests.tiny_models import make_tiny_chat_model
from tests.utilisation import plausible

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytestmark = pytest.mark.usefixtures("peaks_measured_once")

NUM_PROMPTS = 3


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("spec") / "llama")


def _argv(model, out_dir, *extra: str) -> list[str]:
    return ["bench", "spec", str(model), "--num-prompts", str(NUM_PROMPTS), "--max-tokens", "10",
            "--input-len-range", "4:300", "--concurrency", "1", "2", "--peer", "none", "--kv-cache-memory", "16MiB",
            "--output-dir", str(out_dir), *extra]  # fmt: skip


def test_spec_bench_end_to_end(tiny_llama, tmp_path, capsys):
    out_dir = tmp_path / "results"
    argv = _argv(tiny_llama, out_dir, "--methods", "none", "ngram", "draft", "--draft-model", str(tiny_llama),
                 "--quantization", "none", "--ignore-eos")  # fmt: skip
    assert main(argv) == 0
    [json_path] = out_dir.glob("*.json")
    assert json_path.stem.startswith("spec_llama_")
    assert json_path.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    markdown = json_path.with_name(json_path.stem + ".md").read_text()
    assert "**grounded**" in markdown and "**chat**" in markdown

    report = json.loads(json_path.read_text())
    assert report["benchmark"] == "spec" and report["machine"]["cores"] >= 1
    assert report["command"].startswith(f"folio bench spec {tiny_llama} --methods none ngram draft ")
    assert "--concurrency 1 2" in report["command"] and "--no-stop-at-eos" in report["command"]
    assert [(v["name"], v["baseline"]) for v in report["variants"]] == [("none", "none"), ("ngram", "none"),
                                                                         ("draft", "none")]  # fmt: skip
    assert [s["name"] for s in report["servers"]] == ["folio none", "folio ngram", "folio draft"]
    assert "--speculative-method draft" in report["servers"][2]["command"]
    assert set(report["load_s"]) == {"none", "ngram", "draft"}

    cells = {(c["variant"], c["workload"], c["setting"]): c for c in report["results"]}
    assert set(cells) == {(v, w, s) for v in ("none", "ngram", "draft") for w in ("grounded", "chat")
                          for s in ("batch1", "c1", "c2")}  # fmt: skip
    for (variant, _, setting), cell in cells.items():
        assert cell["engine"] == "folio" and cell["completed"] == cell["num_requests"] == NUM_PROMPTS
        assert cell["output_tokens"] == NUM_PROMPTS * 10  # EOS ignored: every answer is max-tokens long
        assert cell["output_tokens_per_s"] > 0 and cell["tpot_ms"]["p50"] > 0 and cell["ttft_ms"]["p50"] > 0
        assert cell["speedup"] > 0 and (variant != "none" or cell["speedup"] == 1.0)
        # Fractions of the peaks measured at the start: MFU everywhere, MBU at batch 1 only (a served step's
        # batch is the server's); a speculative MBU is effective and may pass 1, so only its sign is checked.
        assert plausible(cell["mfu"])
        if setting != "batch1":
            assert cell["mbu"] is None
        else:
            assert cell["mbu"] > 0 and (variant != "none" or plausible(cell["mbu"]))
        spec = cell["spec"]
        if variant == "none":
            assert spec is None
            continue
        # The counts came from the engine: in process its counters, served its /metrics.
        assert spec["source"] == ("engine" if setting == "batch1" else "/metrics")
        assert 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"] and spec["num_drafts"] >= 1
        if variant == "draft":  # the target drafting for itself: every draft accepted, the answers unchanged
            assert spec["num_accepted_tokens"] == spec["num_draft_tokens"] > 0 and spec["acceptance_rate"] == 1.0
        if setting == "batch1":
            assert cell["matches_baseline"] == NUM_PROMPTS
    assert {b["bar"] for b in report["bars"]} >= {"ngram >= 2x none at batch 1 on grounded"}
    assert report["peaks"]["dtype"] == "float32" and report["peaks"]["matmul_gflops"] > 0
    assert report["peaks"]["read_gbps"] > 0
    assert "| MFU % | MBU % |" in markdown

    printed = capsys.readouterr().out
    assert printed.startswith(f"speculative decoding: {tiny_llama}, {NUM_PROMPTS} requests per workload")
    for line in ("grounded ", "chat ", "batch1 draft", "c2     ngram", "ngram >= 2x none at batch 1 on grounded:",
                 "n/a   draft >= 0.95x none on chat at concurrency 16: not measured", str(json_path),
                 "  same  MFU %  MBU %", "peaks measured at the start: "):  # fmt: skip
        assert line in printed


def _one_error_line(capsys) -> str:
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("folio: error:")]
    assert len(errors) == 1, errors
    return errors[0]


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (["--methods", "none", "bogus"], "--methods: unknown speculative method 'bogus'; this folio has none, ngram"),
        (["--methods", "none", "draft"], "--methods draft needs --draft-model"),
        (["--methods", "ngram"], "--methods must include none: every speedup is measured against it"),
        (["--speculative-method", "ngram"], "folio bench spec takes its methods from --methods"),
        (["--peer", "vllm"], "unknown --peer 'vllm'; choose from llama.cpp, none"),
    ],
)
def test_bad_options_give_one_line_before_anything_runs(tiny_llama, tmp_path, capsys, extra, error):
    assert main(_argv(tiny_llama, tmp_path / "out", *extra)) == 1
    assert _one_error_line(capsys).startswith(f"folio: error: {error}")
    assert not (tmp_path / "out").exists()


def test_llama_cpp_needs_a_gguf_and_says_so_before_any_run(tiny_llama, tmp_path, capsys):
    argv = _argv(tiny_llama, tmp_path / "out", "--workloads", "chat")
    argv[argv.index("--peer") + 1] = "llama.cpp"
    assert main(argv) == 1
    assert _one_error_line(capsys) == f"folio: error: --peer llama.cpp needs a GGUF model, and {tiny_llama} is " \
                                      f"{tiny_llama}"  # fmt: skip
