"""What a CUDA graph of a decode step computes, checked on the CPU: the step padded to its bucket
(scratch rows, tables widened with masked columns), run eagerly, gives the real rows the hidden states
of the unpadded step. The capture and replay themselves need a GPU (tests/oracle/test_cuda_vs_transformers.py)."""

from __future__ import annotations

import pytest
import torch

from folio.config import CacheConfig, SchedulerConfig
from folio.engine.engine_core import EngineCore
from folio.loaders.model_loader import load_model
from folio.worker.cuda_graphs import BATCH_BUCKETS, DecodeGraphs, batch_bucket, width_bucket
from tests.engine_driver import run_greedy_capturing_logits
from tests.tiny_models import VOCAB, make_tiny_model

NUM_BLOCKS = 256
SCRATCH = NUM_BLOCKS - 1  # never reached by these short requests: checked at every step


def test_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 256)] == [1, 2, 4, 4, 8, 8, 16, 256]
    assert batch_bucket(BATCH_BUCKETS[-1] + 1) is None
    assert [width_bucket(n) for n in (1, 2, 3, 4, 5, 17)] == [1, 2, 4, 4, 8, 32]


@pytest.mark.parametrize("kind", ["llama", "gemma3", "mistral-window"])
def test_padded_decode_step_equals_the_step(kind, tmp_path):
    """gemma3: two KV cache groups (window and global tables); mistral-window: blocks dropped behind
    the window (placeholders in the tables)."""
    loaded = load_model(make_tiny_model(kind, tmp_path / kind), torch.float32, torch.device("cpu"))
    engine = EngineCore(loaded.model, loaded.config, CacheConfig(block_size=4, num_blocks=NUM_BLOCKS),
                        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512),
                        torch.float32, torch.device("cpu"))  # fmt: skip
    for layer in loaded.model.attention_layers():  # the PyTorch attention path, as on a GPU
        layer.decode_kernel = None
    runner = engine.runner
    groups = engine.kv_groups.num_groups
    graphs = DecodeGraphs(loaded.model, 4, SCRATCH, groups, torch.device("cpu"))
    eager_forward = runner.forward
    checked = []

    def checking_forward(inputs, out):
        hidden = eager_forward(inputs, out)
        if graphs.takes(out):
            step = graphs.pad(out, runner.requests)
            held = {b for c in out.scheduled for table in runner.requests[c.request_id].block_tables for b in table}
            assert SCRATCH not in held
            assert step.batch == batch_bucket(len(out.scheduled)) and all(len(t) == groups for t in step.tables)
            padded = loaded.model(torch.tensor(step.input_ids), torch.tensor(step.positions),
                                  graphs.metadata(step, "cpu"))  # fmt: skip
            torch.testing.assert_close(padded[: len(out.scheduled)], hidden, atol=1e-5, rtol=0)
            checked.append((len(out.scheduled), step.batch, step.width))
        return hidden

    runner.forward = checking_forward
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (30, 5, 11)]
    run_greedy_capturing_logits(engine, prompts, 20)
    assert any(rows < batch for rows, batch, _ in checked)  # scratch rows were padded in
    assert len({width for *_, width in checked}) > 1  # and the tables widened to more than one bucket
