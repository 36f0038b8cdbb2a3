"""GGUF 4-bit weights kept packed (the int4 kernel, bf16 activations) against the same weights
dequantized to fp32, on both real models, teacher-forced: every position of the dequantized model's
greedy continuation is scored by both, so one early disagreement cannot hide the rest."""

from __future__ import annotations

import pytest
import torch

from folio.config import CacheConfig, SchedulerConfig
from folio.engine.engine_core import EngineCore
from folio.engine.model_loader import load_model
from tests.engine_driver import run_greedy_capturing_logits
from tests.oracle.test_real_models_vs_transformers import NEW_TOKENS, PROMPTS


def _engine(loaded) -> EngineCore:
    return EngineCore(loaded.model, loaded.config, CacheConfig(num_blocks=256),
                      SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=2048),
                      torch.float32, torch.device("cpu"))  # fmt: skip


@pytest.fixture(scope="module", params=["smollm2_gguf", "gemma3_gguf"])
def both(request):
    path = request.getfixturevalue(request.param)
    cpu = torch.device("cpu")
    return load_model(path, torch.float32, cpu), load_model(path, torch.float32, cpu, quantization="none")


def test_packed_weights_are_smaller_and_score_like_the_dequantized_ones(both):
    packed, dense = both
    assert packed.weight_bytes < dense.weight_bytes
    num_packed = sum(getattr(m, "packed", None) is not None for m in packed.model.modules())
    assert num_packed > 0
    prompts = [packed.tokenizer.encode(p) for p in PROMPTS]
    outputs, dense_logits = run_greedy_capturing_logits(_engine(dense), prompts, NEW_TOKENS)
    sequences = [p + o[:-1] for p, o in zip(prompts, outputs, strict=True)]
    _, packed_logits = run_greedy_capturing_logits(_engine(packed), sequences, 1)
    agree = total = 0
    worst = 0.0
    for a, b in zip(packed_logits, dense_logits, strict=True):
        a = a[: len(b)]
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(b)
        worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
    print(f"{num_packed} packed layers; top-1 agreement {agree}/{total}; worst relative logit gap {worst:.4f}")
    assert agree / total >= 0.97
    assert worst < 0.05
