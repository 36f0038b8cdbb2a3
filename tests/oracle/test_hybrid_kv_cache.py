"""Gemma 3's window and global layers in their own block tables (kv_cache/groups.py): the real file
generates exactly what one table for every layer generates, past its 512-token window, while its
window layers hold a window's worth of blocks instead of the whole context."""

from __future__ import annotations

import pytest
import torch
from folio_tools.kv_calc import window_tokens_held

from folio import LLM, SamplingParams
from folio.engine.request import Request

PROMPT_TOKENS = 1_500  # three windows
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(1_000, 30_000, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(3)).tolist()


def _peak_layer_blocks(llm: LLM, prompt: list[int]) -> int:
    """The most blocks the request held at once, in layers' blocks of 16 tokens (a block holds
    `layers_per_block` layers' K/V)."""
    core = llm.engine
    core.add_request(Request("peak", prompt, GREEDY))
    peak = 0
    while core.has_unfinished():
        core.step()
        peak = max(peak, core.kv.pool.num_blocks - core.kv.pool.num_free_blocks)
    core.step()  # an empty step tells the runner the request ended
    return peak * core.kv_groups.layers_per_block


def test_gemma3_generates_the_same_with_a_table_per_group_and_holds_far_less(gemma3_gguf, prompt):
    hybrid = LLM(gemma3_gguf, kv_cache_memory="160MiB")
    one = LLM(gemma3_gguf, kv_cache_memory="160MiB", hybrid_kv_cache=False)
    assert hybrid.engine.kv.group_windows == (None, 512, 512, 512, 512, 512)
    assert one.engine.kv.group_windows == (None,)
    [a], [b] = hybrid.generate([prompt], GREEDY, use_tqdm=False), one.generate([prompt], GREEDY, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
        assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
    # One table: every position's block for all 18 layers. A table per group: every block for the 3 global
    # layers, and for each of the 15 window layers about a window and a step (512 + 1,024 prefill tokens).
    with_groups, without = _peak_layer_blocks(hybrid, prompt), _peak_layer_blocks(one, prompt)
    assert without == -(-(PROMPT_TOKENS + GREEDY.max_tokens - 1) // 16) * 18
    # The window tables hold at most what `folio kv-calc` says a window layer holds while decoding (and the
    # placeholder's place, 3 layer-blocks more, when it is not one of their own blocks).
    global_blocks = -(-(PROMPT_TOKENS + GREEDY.max_tokens - 1) // 16)
    window_blocks = with_groups - 3 * global_blocks
    assert 15 * 512 // 16 <= window_blocks <= 15 * window_tokens_held(512) // 16 + 3
    assert hybrid.engine.kv.pool.num_free_blocks == hybrid.engine.kv.pool.num_blocks
