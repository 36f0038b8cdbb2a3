"""`folio bench lora`'s own pieces, without servers: the adapters it makes are ones peft and folio both
load whole, requests cycle over the adapters as the benchmark says, and the summary's ratios are per
round."""

from __future__ import annotations

import json

import pytest
import torch
from folio_tools.bench.lora.adapters import make_adapter, projection_shapes
from folio_tools.bench.lora.command import EngineRuns, LoRABenchConfig, folio_bodies, llama_bodies, summarize

from folio import LLM
from folio.lora.adapter import read_adapter
from tests.tiny_models import make_tiny_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def test_the_benchmarks_adapters_load_whole_in_peft_and_folio(tmp_path):
    base = make_tiny_model("llama", tmp_path / "base")
    hf = json.loads((base / "config.json").read_text())
    adapter = make_adapter(hf, tmp_path / "adapter", rank=4, seed=1)

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(model, adapter)
    lora_weights = [name for name, _ in loaded.named_parameters() if "lora_" in name]
    assert len(lora_weights) == 2 * len(projection_shapes(hf)) * hf["num_hidden_layers"]  # A and B of each

    llm = LLM(base, enable_lora=True, num_kv_blocks=32, block_size=4)
    parts = read_adapter("a", str(adapter), llm.loaded.model).parts
    assert len(parts) == len(projection_shapes(hf)) * hf["num_hidden_layers"]
    assert all(part.a.shape[0] == 4 for part in parts)


def test_requests_cycle_over_the_adapters():
    config = LoRABenchConfig("m", batch=6)
    assert [body["model"] for body in folio_bodies(config, "base", 4)] == ["a0", "a1", "a2", "a3", "a0", "a1"]
    assert {body["model"] for body in folio_bodies(config, "base", 0)} == {"base"}
    assert [body["lora"] for body in llama_bodies(config, 2)][:3] == [[{"id": 0, "scale": 1.0}],
                                                                      [{"id": 1, "scale": 1.0}],
                                                                      [{"id": 0, "scale": 1.0}]]  # fmt: skip
    assert all(body["lora"] == [] and body["ignore_eos"] for body in llama_bodies(config, 0))
    with pytest.raises(ValueError, match="--adapters"):
        LoRABenchConfig("m", counts=(0, 4))


def test_the_summary_takes_each_rounds_ratio_before_the_median():
    folio = EngineRuns("folio serve", {0: [100.0, 200.0, 150.0], 4: [90.0, 160.0, 150.0]})
    llama = EngineRuns("llama-server", {0: [50.0, 50.0, 50.0], 4: [10.0, 20.0, 30.0]})
    summary = summarize({"folio": folio, "llama.cpp": llama}, (0, 4))
    assert summary["folio"][4]["tok_s"] == 150.0
    assert summary["folio"][4]["vs_base"] == pytest.approx(0.9)  # rounds: 0.9, 0.8, 1.0
    assert summary["llama.cpp"][4]["vs_base"] == pytest.approx(0.4)
    assert summary["folio_vs_llama_cpp"][4] == pytest.approx(8.0)  # rounds: 9, 8, 5
