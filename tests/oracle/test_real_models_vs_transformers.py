"""The two real GGUF models: folio and transformers (which dequantizes GGUF) agree on greedy tokens
and logits, with all prompts sharing folio's batches."""

from __future__ import annotations

import pytest
import torch

from folio.config import CacheConfig, SchedulerConfig
from folio.engine.engine_core import EngineCore
from folio.loaders.model_loader import load_model
from tests.engine_driver import run_greedy_capturing_logits
from tests.reference import reference_greedy

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Here is a list of three fruits:\n1.",
    "Question: Why is the sky blue?\nAnswer:",
    "Translate to German: The weather is nice today. ->",
    "Once upon a time, in a small village by the sea, there lived",
    "The year 1969 was notable because",
    "Les mathématiques sont",
]
NEW_TOKENS = 16  # every position of 8 prompts through chunked, batched steps; more only repeats decode
# Both sides dequantize the same GGUF blocks to fp32; the rest differs only in summation order
# (fused q/k/v and gate/up matmuls, batched attention), which moves logits by ~1e-4 at most.
LOGIT_TOLERANCE = 2e-3


@pytest.fixture(scope="module", params=["smollm2_gguf", "gemma3_gguf"])
def models(request):
    path = request.getfixturevalue(request.param)
    # The model's math against transformers on the same dequantized weights: no 4-bit kernels here
    # (tests/oracle/test_packed_gguf_weights.py compares those with this dequantized path).
    loaded = load_model(path, torch.float32, torch.device("cpu"), quantization="none")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    return loaded, reference


def test_greedy_tokens_and_logits_match(models):
    loaded, reference = models
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    engine = EngineCore(
        loaded.model,
        loaded.config,
        CacheConfig(num_blocks=256),
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=2048),  # chunked + batched
        torch.float32,
        torch.device("cpu"),
    )
    outputs, logits = run_greedy_capturing_logits(engine, prompts, NEW_TOKENS)
    worst = 0.0
    for prompt, output, folio_logits in zip(prompts, outputs, logits, strict=True):
        ref_tokens, ref_logits = reference_greedy(reference, prompt, NEW_TOKENS)
        assert output == ref_tokens, loaded.tokenizer.decode(prompt)
        worst = max(worst, (folio_logits - ref_logits).abs().max().item())
    assert worst < LOGIT_TOLERANCE, worst
