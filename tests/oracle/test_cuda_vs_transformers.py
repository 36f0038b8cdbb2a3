"""On a CUDA GPU: folio's logits and greedy tokens equal transformers' on the tiny models of every
architecture, with each pure decode step replayed from a captured CUDA graph and with none
(--enforce-eager). Skipped where there is no GPU (the CPU suite checks the graphs' padding in
tests/unit/test_cuda_graph_padding.py)."""

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
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DECODE_STEPS = 24
TOLERANCE = 2e-4  # float32 on both sides; cuBLAS and the CPU sum in different orders
SCHEDULES = {"whole": (1024, 256), "chunked": (7, 256), "preempting": (16, 20)}


@pytest.fixture(scope="module", params=TINY_KINDS + NEW_ARCHITECTURE_KINDS)
def tiny(request, tmp_path_factory):
    folder = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    loaded = load_model(folder, torch.float32, torch.device("cuda"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, loaded, reference


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_cuda_logits_and_greedy_tokens_match(tiny, schedule, graphs):
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
        torch.device("cuda"),
        cuda_graphs=graphs,
    )
    outputs, logits = run_greedy_capturing_logits(engine, prompts, DECODE_STEPS)
    for prompt, output, folio_logits in zip(prompts, outputs, logits, strict=True):
        ref_tokens, ref_logits = reference_greedy(reference, prompt, DECODE_STEPS)
        assert output == ref_tokens
        torch.testing.assert_close(folio_logits.cpu(), ref_logits, atol=TOLERANCE, rtol=0)
    if graphs:
        assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    else:
        assert engine.runner.graphs is None
    if schedule == "preempting":
        assert engine.scheduler.num_preemptions > 0
    assert engine.kv.pool.num_free_blocks == num_blocks
