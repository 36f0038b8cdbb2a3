"""How a pipeline divides a model (layer ranges) and a step (micro-batches)."""

from __future__ import annotations

import pytest

from folio.config import ModelConfig
from folio.distributed.pipeline_parallel import layer_weights, partition_layers
from folio.engine_args import parse_layer_counts
from folio.worker.pipeline_step import Span, micro_batches, split_spans


def _config(num_layers: int, vocab_size: int, hidden: int = 64) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab_size, hidden_size=hidden,
                       intermediate_size=4 * hidden, num_layers=num_layers, num_heads=4, num_kv_heads=2,
                       head_dim=hidden // 4, max_position_embeddings=128)  # fmt: skip


def test_layers_split_evenly_when_the_head_is_small():
    assert partition_layers(_config(8, vocab_size=16), 2) == [range(0, 4), range(4, 8)]
    assert partition_layers(_config(9, vocab_size=16), 3) == [range(0, 3), range(3, 6), range(6, 9)]


def test_a_heavy_head_leaves_the_last_stage_fewer_layers():
    config = _config(30, vocab_size=4000)
    layer, head = layer_weights(config), config.vocab_size * config.hidden_size
    first, last = partition_layers(config, 2)
    assert first.start == 0 and first.stop == last.start and last.stop == 30
    assert len(first) > len(last)
    heaviest = max(len(first) * layer, len(last) * layer + head)
    # No other cut does better.
    assert all(max(k * layer, (30 - k) * layer + head) >= heaviest for k in range(1, 30))


def test_every_stage_keeps_a_layer_even_under_a_huge_head():
    assert partition_layers(_config(4, vocab_size=10**6), 2) == [range(0, 3), range(3, 4)]


def test_layer_counts_given_by_the_user():
    assert partition_layers(_config(18, vocab_size=10**6), 2, (9, 9)) == [range(0, 9), range(9, 18)]
    for wrong in ((9,), (10, 9), (18, 0)):
        with pytest.raises(ValueError, match="add up to the model's 18 layers"):
            partition_layers(_config(18, vocab_size=16), 2, wrong)


def test_layer_counts_on_the_command_line():
    assert parse_layer_counts("9,9") == (9, 9)
    assert parse_layer_counts(None) is None
    with pytest.raises(ValueError, match="--pipeline-layers"):
        parse_layer_counts("9;9")


def test_more_stages_than_layers_is_an_error():
    with pytest.raises(ValueError, match="this model has 2 layers"):
        partition_layers(_config(2, vocab_size=16), 3)


def test_decodes_spread_over_micro_batches():
    spans = [Span(10 + i, 1, [i]) for i in range(8)]
    runs = split_spans(spans, 4)
    assert [[s.start for s in run] for run in runs] == [[10, 11], [12, 13], [14, 15], [16, 17]]


def test_a_long_prompt_is_cut_into_contiguous_pieces():
    runs = split_spans([Span(0, 10, [0, 1]), Span(5, 1, [2])], 2)
    assert [[(s.start, s.num_tokens) for s in run] for run in runs] == [[(0, 6)], [(6, 4), (5, 1)]]


def test_a_draft_verification_is_never_cut():
    runs = split_spans([Span(0, 1, [0]), Span(20, 5, [1], keep_whole=True), Span(3, 1, [2])], 2)
    assert [[(s.start, s.num_tokens) for s in run] for run in runs] == [[(0, 1), (20, 5)], [(3, 1)]]


def test_fewer_tokens_than_micro_batches_gives_one_per_token():
    assert len(split_spans([Span(7, 1, [0])], 4)) == 1


def test_micro_batches_cover_the_step_rows_in_order():
    spans = [Span(0, 7, [0]), Span(3, 1, [1]), Span(9, 1, [2])]
    batches = micro_batches(spans, 3, block_size=16, device="cpu")
    rows = [b.rows for b in batches]
    assert rows[0].start == 0 and rows[-1].stop == 9
    assert all(a.stop == b.start for a, b in zip(rows, rows[1:], strict=False))
    assert sum(b.meta.num_tokens for b in batches) == 9
