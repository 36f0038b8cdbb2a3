"""The two real GGUF models: folio and transformers (which dequantizes GGUF) agree on greedy tokens
and logits, with all prompts sharing folio's batches, and with a LoRA adapter made by peft."""

from __future__ import annotations

import pytest
import torch

from folio.config import CacheConfig, SchedulerConfig
from folio.engine.engine_core import EngineCore
from folio.loaders.model_loader import load_model
from folio.lora.adapter import LoRARequest
from folio.lora.store import LoRAStore
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


def test_an_adapter_on_the_real_model_matches_peft(models, tmp_path):
    """A random rank-8 LoRA adapter on every projection, made with peft on the transformers model: folio's
    greedy tokens and logits with it are peft's, on the same dequantized weights, in a batch beside the
    base model's rows."""
    peft = pytest.importorskip("peft")
    loaded, reference = models
    torch.manual_seed(7)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    adapted = peft.get_peft_model(reference, config)
    try:
        with torch.no_grad():
            for name, param in adapted.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn_like(param) * 0.05)
        adapted.save_pretrained(tmp_path / "adapter")
        engine = EngineCore(loaded.model, loaded.config, CacheConfig(num_blocks=128),
                            SchedulerConfig(max_num_seqs=4, max_model_len=2048), torch.float32,
                            torch.device("cpu"))  # fmt: skip
        engine.runner.lora = LoRAStore(loaded.model, 1, 8, torch.float32, torch.device("cpu"))
        engine.add_lora(LoRARequest("random", str(tmp_path / "adapter")))
        prompts = [loaded.tokenizer.encode(p) for p in PROMPTS[:2]]
        outputs, logits = run_greedy_capturing_logits(engine, prompts * 2, 8, ["random", "random", None, None])
        for prompt, output, folio_logits in zip(prompts, outputs[:2], logits[:2], strict=True):  # the adapter's rows
            ref_tokens, ref_logits = reference_greedy(adapted, prompt, 8)
            assert output == ref_tokens, loaded.tokenizer.decode(prompt)
            assert (folio_logits - ref_logits).abs().max().item() < LOGIT_TOLERANCE
        assert (logits[0] - logits[2]).abs().max().item() > 0.5  # the adapter changes the model's answer
    finally:
        adapted.unload()  # the transformers model as it was, for the module's other tests
