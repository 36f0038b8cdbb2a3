"""`folio bench parallel` end to end on a tiny model: every engine measured, ratios against tp1, the
communication per step reported for the split ones."""

from __future__ import annotations

import json

import pytest
from folio_tools.bench.parallel.command import Split, parse_engine

from folio.cli import main
from tests.tiny_models import make_tiny_model

pytest.importorskip("matplotlib")
pytestmark = pytest.mark.usefixtures("peaks_measured_once")


def test_parallel_bench_end_to_end(tmp_path, capsys):
    model = make_tiny_model("llama", tmp_path / "llama")
    out_dir = tmp_path / "results"
    # Each split and each transport once (shm: pp2 and cp2; gloo: tp2-gloo); every split engine starts two ranks.
    code = main(["bench", "parallel", str(model), "--engines", "tp1", "tp2-gloo", "pp2", "cp2", "--rounds",
                 "1", "--batch", "4", "--prompt-tokens", "16", "--batch1-tokens", "8", "--batch-tokens", "4",
                 "--long-prompt-tokens", "100", "--max-num-batched-tokens", "32", "--kv-cache-memory", "16MiB",
                 "--output-dir", str(out_dir)])  # fmt: skip
    assert code == 0
    [json_file] = list(out_dir.glob("parallel_*.json"))
    assert json_file.with_suffix(".png").exists()
    report = json.loads(json_file.read_text())
    engines = report["engines"]
    assert list(engines) == ["tp1", "tp2-gloo", "pp2", "cp2"]
    assert engines["tp1"]["median"]["batch1_ratio"] == 1.0 and engines["tp1"]["median"]["long_prefill_ratio"] == 1.0
    for name in ("tp2-gloo", "pp2", "cp2"):
        median = engines[name]["median"]
        assert median["batch1_decode_tok_s"] > 0 and median["batch_output_tok_s"] > 0
        assert median["long_prefill_tok_s"] > 0 and median["long_prefill_ratio"] > 0
        assert 0 < median["comm_ms_per_step_batch1"] < median["step_ms_batch1"]
        assert median["comm_kib_per_step_batch"] > 0
        assert median["batch1_mbu"] > 0 and median["batch_mfu"] > 0 and median["long_prefill_mfu"] > 0
    # The long prompt's 100 tokens in chunks of at most 32 (25 rows a step on average): in each of 3
    # layers every row's query [4 heads x 16] is gathered and its partials [4 x 17] swapped.
    assert engines["cp2"]["median"]["comm_kib_per_step_long"] >= 3 * 25 * 4 * 16 * 4 / 1024
    # A pipeline's stage 0 sends each token's hidden state and residual: at least [2, 1, 64] float32 a step.
    assert engines["pp2"]["median"]["comm_kib_per_step_batch1"] >= 2 * 64 * 4 / 1024
    assert report["peaks"]["read_gbps"] > 0
    out = capsys.readouterr().out
    assert "tp2-gloo" in out and "b1 MBU" in out and "long MFU" in out


@pytest.mark.parametrize("name", ["tp", "tp0", "pp", "tp2xtp2", "pp2x", "tp2-nccl", "dp2", "cp2xtp2"])
def test_an_unknown_engine_is_refused(name):
    with pytest.raises(ValueError, match="--engines"):
        parse_engine(name)


def test_engine_names():
    assert parse_engine("tp1") == Split()
    assert parse_engine("tp2-gloo") == Split(2, 1, "gloo")
    assert parse_engine("pp2") == Split(1, 2)
    assert parse_engine("tp2xpp2") == Split(2, 2)
    assert parse_engine("cp2-gloo") == Split(1, 1, "gloo", 2)
