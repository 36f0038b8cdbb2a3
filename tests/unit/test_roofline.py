"""MFU and MBU arithmetic: a token's FLOPs and bytes from the model's shapes, against measured peaks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from folio_tools.bench.harness import roofline
from folio_tools.bench.harness.roofline import MachinePeaks, TokenCost, measure_peaks, multiplied_parameters

from folio.config import ModelConfig


def test_a_tokens_flops_and_bytes() -> None:
    cost = TokenCost(multiplied_params=1_000_000, num_layers=4, attention_width=256, weight_bytes=8_000_000,
                     kv_bytes_per_token=2_048)  # fmt: skip
    # 2 FLOPs per multiplied weight, and QK^T and PV: 2 x 2 x layers x width per context token.
    assert cost.flops(context=100) == 2_000_000 + 4 * 4 * 256 * 100
    # The weights are read once per step and shared by the batch; each sequence reads its own KV.
    assert cost.decode_bytes(batch=1, context=100) == 8_000_000 + 100 * 2_048
    assert cost.decode_bytes(batch=8, context=100) == 1_000_000 + 100 * 2_048
    peaks = MachinePeaks("float32", matmul_gflops=100.0, read_gbps=50.0)
    shares = cost.utilisation(tokens_per_s=10.0, batch=1, context=100, peaks=peaks)
    assert shares["mfu"] == pytest.approx(10 * cost.flops(100) / 100e9)
    assert shares["mbu"] == pytest.approx(10 * cost.decode_bytes(1, 100) / 50e9)


def test_a_prompt_runs_the_lm_head_once() -> None:
    cost = TokenCost(multiplied_params=1_000_000, num_layers=4, attention_width=256, weight_bytes=8_000_000,
                     kv_bytes_per_token=2_048, head_params=300_000)  # fmt: skip
    layers = 2 * 700_000 * 512 + 4 * 4 * 256 * (512 * 513 / 2)  # token i attends to the i tokens up to itself
    assert cost.prefill_flops(512) == pytest.approx(layers + 2 * 300_000)
    assert cost.prefill_flops(1) == cost.flops(context=1)
    peaks = MachinePeaks("float32", matmul_gflops=100.0, read_gbps=50.0)
    assert cost.prefill_mfu(512, 1000.0, peaks) == pytest.approx(1000 / 512 * cost.prefill_flops(512) / 100e9)


def test_a_served_requests_flops_are_its_prefill_then_each_later_token() -> None:
    cost = TokenCost(multiplied_params=1_000_000, num_layers=4, attention_width=256, weight_bytes=0,
                     kv_bytes_per_token=0, head_params=300_000)  # fmt: skip
    later = sum(cost.flops(context=100 + i) for i in range(1, 20))  # tokens 2..20 attend to 101..119 tokens
    assert cost.request_flops(100, 20) == pytest.approx(cost.prefill_flops(100) + later)
    assert cost.request_flops(100, 1) == cost.prefill_flops(100)


def test_the_embedding_lookup_is_not_multiplied_unless_the_head_shares_it() -> None:
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )
    table = config.vocab_size * config.hidden_size
    untied = dataclasses.replace(config, tie_word_embeddings=False)
    tied = dataclasses.replace(config, tie_word_embeddings=True)
    assert multiplied_parameters(untied, 10 * table) == 9 * table
    assert multiplied_parameters(tied, 10 * table) == 10 * table


def test_peaks_are_measured_positive() -> None:
    peaks = measure_peaks(torch.float32, repeats=1)
    assert peaks.matmul_gflops > 0 and peaks.read_gbps > 0 and peaks.dtype == "float32"


def test_a_dtype_slower_than_float32_takes_float32s_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without bfloat16 arithmetic (AVX2) a bfloat16 GEMM is emulated far below float32's rate, which
    the model's widened products then pass: MFU is against the higher of the two."""
    rates = {torch.float32: 150.0, torch.bfloat16: 9.0}
    monkeypatch.setattr(roofline, "gemm_gflops", lambda dtype, repeats, device: rates[dtype])
    assert measure_peaks(torch.bfloat16, repeats=1).matmul_gflops == 150.0
    rates[torch.bfloat16] = 420.0  # AVX-512 BF16: bfloat16's own rate
    peaks = measure_peaks(torch.bfloat16, repeats=1)
    assert peaks.matmul_gflops == 420.0 and peaks.dtype == "bfloat16"
    assert measure_peaks(torch.float32, repeats=1).matmul_gflops == 150.0
