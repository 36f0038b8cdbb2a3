"""`folio bench quantization` end to end on a tiny Llama: every row measured, checkpoints made once."""

from __future__ import annotations

import json

import pytest

from folio.cli import main
from tests.tiny_models import make_tiny_model
from tests.utilisation import plausible

pytestmark = pytest.mark.usefixtures("peaks_measured_once")


def test_quantization_table_end_to_end(tmp_path, capsys):
    model = make_tiny_model("llama", tmp_path / "tiny")
    args = ["bench", "quantization", str(model), "--formats", "fp32,bf16,int4,nf4", "--kv-cache-dtypes", "auto,int8",
            "--dtype", "float32", "--num-tokens", "512", "--num-prompts", "4", "--gen-tokens", "4", "--batch", "2",
            "--checkpoint-dir", str(tmp_path / "checkpoints"), "--output-dir", str(tmp_path / "results")]  # fmt: skip
    assert main(args) == 0
    [result] = (tmp_path / "results").glob("quantization_*.json")
    report = json.loads(result.read_text())
    rows = report["rows"]
    assert [(r["weights"], r["kv_cache_dtype"]) for r in rows] == [
        (w, kv) for w in ("fp32", "bf16", "int4", "nf4") for kv in ("auto", "int8")
    ]
    by = {(r["weights"], r["kv_cache_dtype"]): r for r in rows}
    # --dtype is every row's compute dtype but the dense formats': theirs is their own.
    dtypes = {"fp32": "float32", "bf16": "bfloat16", "int4": "float32", "nf4": "float32"}
    assert all(r["compute_dtype"] == dtypes[r["weights"]] for r in rows)
    assert by["fp32", "auto"]["identical"] == 4  # the fp32 model agrees with itself
    assert by["int4", "auto"]["weight_mib"] < by["bf16", "auto"]["weight_mib"] < by["fp32", "auto"]["weight_mib"]
    assert by["bf16", "int8"]["kv_bytes_per_token"] < by["bf16", "auto"]["kv_bytes_per_token"]
    assert all(r["perplexity"] > 1 and r["batch1_tok_s"] > 0 and r["batch_tok_s"] > 0 for r in rows)
    assert by["int4", "auto"]["quantize_seconds"] > 0 and by["fp32", "auto"]["quantize_seconds"] is None
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["tiny-int4-g32", "tiny-nf4-g32"]
    # Utilisation against the peaks measured once at the start, in the run's dtype; each row's MBU counts its
    # own resident bytes, so it is the row's rate times its bytes per token over the one read peak.
    peaks = report["peaks"]
    assert peaks["dtype"] == "float32" and peaks["matmul_gflops"] > 0 and peaks["read_gbps"] > 0
    assert all(plausible(r["batch1_mbu"]) and plausible(r["batch_mfu"]) for r in rows)
    for key in (("fp32", "auto"), ("int4", "auto")):
        row = by[key]
        bytes_per_token = row["batch1_mbu"] * peaks["read_gbps"] * 1e9 / row["batch1_tok_s"]
        weight_bytes = row["weight_mib"] * 2**20  # the weights, plus a short prompt's KV
        assert weight_bytes < bytes_per_token < weight_bytes + 200 * row["kv_bytes_per_token"]
    printed = capsys.readouterr().out
    assert "ppl vs fp32" in printed and "b1 MBU %" in printed and "MFU %" in printed
    assert "GB/s read" in printed
    # A second run reuses the checkpoints.
    assert main([*args[:4], "int4", "--kv-cache-dtypes", "auto", *args[7:]]) == 0
    latest = max((tmp_path / "results").glob("quantization_*.json"), key=lambda p: p.stat().st_mtime)
    [again] = json.loads(latest.read_text())["rows"]
    assert (again["weights"], again["kv_cache_dtype"], again["quantize_seconds"]) == ("int4", "auto", None)
