"""`folio bench structured` end to end on the real SmolLM2 (a tiny random model writes no JSON)."""

from __future__ import annotations

import json

import pytest
from folio_tools.bench.structured.command import conversations, is_valid
from folio_tools.bench.structured.schemas import SCHEMAS

from folio.cli import main
from tests.utilisation import plausible

pytest.importorskip("matplotlib")
pytest.importorskip("jsonschema")
pytestmark = pytest.mark.usefixtures("peaks_measured_once")


def test_structured_bench_end_to_end(smollm2_gguf, tmp_path, capsys):
    out_dir = tmp_path / "results"
    code = main(["bench", "structured", str(smollm2_gguf), "--num-prompts", "4", "--max-tokens", "160",
                 "--kv-cache-memory", "64MiB", "--output-dir", str(out_dir)])  # fmt: skip
    assert code == 0
    [json_file], [png_file] = list(out_dir.glob("*.json")), list(out_dir.glob("*.png"))
    assert json_file.stem == png_file.stem and json_file.stem.startswith("structured_")
    assert png_file.read_bytes().startswith(b"\x89PNG")
    report = json.loads(json_file.read_text())
    [folio] = report["results"]
    bound, free = folio["constrained"], folio["unconstrained"]
    assert bound["output_tokens"] == free["output_tokens"] > 0  # the same work on both sides
    assert folio["num_valid"] == folio["num_finished"]  # every output that ended is valid JSON of its schema
    assert folio["num_finished"] >= 3
    assert bound["num_masks"] >= bound["output_tokens"]  # one mask per constrained token, at least
    assert 0 < bound["mask_s"] < bound["elapsed_s"] and bound["mask_ms_per_step"] > 0
    assert folio["throughput_ratio"] == pytest.approx(bound["output_tokens_per_s"] / free["output_tokens_per_s"])
    # MFU of each run against the matmul peak measured at the start: the same FLOPs (same prompts, same token
    # counts) on both sides, so the MFUs stand in the ratio of the throughputs.
    assert report["peaks"]["dtype"] == "float32" and report["peaks"]["matmul_gflops"] > 0
    assert plausible(bound["mfu"]) and plausible(free["mfu"])
    assert bound["mfu"] / free["mfu"] == pytest.approx(folio["throughput_ratio"])
    out = capsys.readouterr().out
    assert "json tok/s" in out and "folio" in out and str(json_file) in out
    assert "json MFU %" in out and "free MFU %" in out and "GFLOP/s (float32 GEMM) measured at the start" in out


def test_workload_cycles_through_every_schema():
    chats = conversations(8)
    assert [name for name, _ in chats][:4] == sorted(SCHEMAS) and len({c[1][0]["content"] for c in chats}) == 8
    assert is_valid('{"city": "Oslo", "forecast": [1.5], "alert": null}', SCHEMAS["weather report"])
    assert not is_valid('{"city": "Oslo"}', SCHEMAS["weather report"]) and not is_valid("{", SCHEMAS["order"])


def test_structured_bench_refuses_an_unknown_peer(tmp_path):
    from folio_tools.bench.structured.command import StructuredConfig, run_structured

    with pytest.raises(ValueError, match="unknown peer"):
        run_structured(StructuredConfig("smollm2-135m", peer="vllm"), "cmd")
