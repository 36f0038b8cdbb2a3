"""`folio bench decode` end to end on the real SmolLM2 (folio only; llama-bench needs a 6-17 minute build)."""

from __future__ import annotations

import json

import pytest

from folio.cli import main
from tests.utilisation import plausible

pytest.importorskip("matplotlib")
pytestmark = pytest.mark.usefixtures("peaks_measured_once")


def test_decode_bench_end_to_end(smollm2_gguf, tmp_path, capsys):
    out_dir = tmp_path / "results"
    code = main(["bench", "decode", str(smollm2_gguf), "--gen-tokens", "4", "--batch", "2", "--repeats", "1",
                 "--prompt-tokens", "16", "--dtype", "bfloat16", "--kv-cache-memory", "64MiB",
                 "--output-dir", str(out_dir)])  # fmt: skip
    assert code == 0
    [json_file], [png_file] = list(out_dir.glob("*.json")), list(out_dir.glob("*.png"))
    assert json_file.stem == png_file.stem and json_file.stem.startswith("decode_") and "bfloat16" in json_file.stem
    report = json.loads(json_file.read_text())
    kept, dense = report["results"]
    assert (kept["engine"], dense["engine"]) == ("folio gguf", "folio dequantized")
    assert kept["weight_mib"] < dense["weight_mib"] / 2  # 4-bit and 8-bit against bf16
    assert kept["batch1_tok_s"] > 0 and dense["batch_tok_s"] > 0
    # Utilisation against the peaks measured at the start: the dense bf16 weights are 4x the bytes.
    assert report["peaks"]["dtype"] == "bfloat16" and report["peaks"]["read_gbps"] > 0
    for result in (kept, dense):
        assert result["batch1_mbu"] > 0 and plausible(result["batch_mfu"])
        assert result["prefill_tok_s"]["16"] > 0 and plausible(result["prefill_mfu"]["16"])
    out = capsys.readouterr().out
    assert "batch-1 tok/s" in out and "MBU" in out and "GB/s read" in out and "pp16 (MFU)" in out


def test_decode_bench_refuses_an_unknown_peer(tmp_path):
    from folio_tools.bench.decode import DecodeConfig, run_decode

    with pytest.raises(ValueError, match="unknown peer"):
        run_decode(DecodeConfig("smollm2-135m", peer="vllm"), "cmd")
