"""folio's logits and greedy tokens equal transformers' on tiny random-init models of each architecture,
whole-prompt, chunked, batched with other requests, and under preemption."""

from __future__ import annotations

import pytest
import torch

from folio.config import CacheConfig, SchedulerConfig
from folio.engine.engine_core import EngineCore
from folio.loaders.model_loader import load_model
from tests.engine_driver import run_greedy_capturing_logits
from tests.reference import reference_greedy
from tests.speculation import preempting_pool
from tests.tiny_models import NEW_ARCHITECTURE_KINDS, TINY_KINDS, VOCAB, make_tiny_model

transformers = pytest.importorskip("transformers")

DECODE_STEPS = 32
TOLERANCE = 1e-4  # fp32


@pytest.fixture(scope="module", params=TINY_KINDS + NEW_ARCHITECTURE_KINDS)
def tiny(request, tmp_path_factory):
    folder = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    loaded = load_model(folder, torch.float32, torch.device("cpu"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, loaded, reference


# (token budget per step, KV blocks of 4 tokens): whole prompts; 7-token chunks; a pool too small for
# all three requests at once, which forces preemption and recomputation. A model whose layers have an
# 8-token window (all of them, or Gemma 3's window group) gives blocks back as they leave it: its pool is
# smaller than one request with every block kept (tests/speculation.py).
SCHEDULES = {"whole": (1024, 256), "chunked": (7, 256), "preempting": (16, 20)}


@pytest.mark.parametrize("attention", ["kernel", "torch"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_logits_and_greedy_tokens_match(tiny, schedule, attention):
    kind, loaded, reference = tiny
    budget, num_blocks = SCHEDULES[schedule]
    if schedule == "preempting":
        num_blocks = preempting_pool(loaded.config)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (40, 5, 23)]
    engine = EngineCore(
        loaded.model,
        loaded.config,
        CacheConfig(block_size=4, num_blocks=num_blocks),
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=512),
        torch.float32,
        torch.device("cpu"),
    )
    if attention == "torch":  # the pure-PyTorch path for every group, decodes included
        for layer in loaded.model.attention_layers():
            layer.decode_kernel = None
    outputs, logits = run_greedy_capturing_logits(engine, prompts, DECODE_STEPS)
    for prompt, output, folio_logits in zip(prompts, outputs, logits, strict=True):
        ref_tokens, ref_logits = reference_greedy(reference, prompt, DECODE_STEPS)
        assert output == ref_tokens
        assert folio_logits.shape == ref_logits.shape  # every prompt position and every decode step
        torch.testing.assert_close(folio_logits, ref_logits, atol=TOLERANCE, rtol=0)
    if schedule == "preempting":
        assert engine.scheduler.num_preemptions > 0
        if engine.kv.drops_blocks:  # 72-token sequences through a pool that holds fewer with every block kept
            assert engine.kv.capacity_tokens < len(prompts[0]) + DECODE_STEPS
    assert engine.kv.pool.num_free_blocks == num_blocks  # everything returned to the pool
