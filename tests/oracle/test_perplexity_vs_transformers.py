"""Perplexity scoring against transformers on a tiny random model: the summed negative log-likelihood
of every next token in each window, with windows chunked and batched by the scheduler."""

from __future__ import annotations

import pytest
import torch
from folio_tools.eval.perplexity import score_windows

from folio import LLM
from tests.tiny_models import VOCAB, make_tiny_model

transformers = pytest.importorskip("transformers")


def test_scored_nll_equals_transformers(tmp_path):
    folder = make_tiny_model("llama", tmp_path / "llama")
    llm = LLM(folder, num_kv_blocks=256, block_size=4, max_num_batched_tokens=48, enable_prefix_caching=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    windows = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (40, 17, 64)]
    total, count = score_windows(llm, windows)
    expected = 0.0
    with torch.no_grad():
        for window in windows:
            logits = reference(torch.tensor([window])).logits[0, :-1].double()
            expected -= float(torch.log_softmax(logits, -1).gather(1, torch.tensor(window[1:]).unsqueeze(1)).sum())
    assert count == sum(len(w) - 1 for w in windows)
    assert total == pytest.approx(expected, rel=1e-5)
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks


def test_scoring_computes_every_position_with_prefix_caching_on(tmp_path):
    """Windows sharing a prefix would hit the prefix cache, whose blocks have no logits: a request that
    scores its prompt computes all of it instead, so the totals do not depend on the cache."""
    folder = make_tiny_model("llama", tmp_path / "llama")
    windows = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10]]
    cached = score_windows(LLM(folder, num_kv_blocks=64, block_size=4), windows)
    uncached = score_windows(LLM(folder, num_kv_blocks=64, block_size=4, enable_prefix_caching=False), windows)
    assert cached[1] == uncached[1] == 16
    assert cached[0] == pytest.approx(uncached[0], rel=1e-6)
