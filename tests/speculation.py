"""What the speculative decoding oracle tests share: an engine on a tiny model under a named
schedule, greedy requests run in waves (the next wave once the last has finished), and the check
that speculation kept every greedy token and logprob."""

from __future__ import annotations

import torch

from folio import SamplingParams
from folio.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from folio.engine.engine_core import EngineCore
from folio.engine.request import Request
from folio.kv_cache.groups import plan_kv_groups
from tests.tiny_models import VOCAB

SCHEDULES = {"whole": (1024, 256), "chunked": (7, 256), "preempting": (16, 20)}  # (token budget, blocks of 4)
WINDOWED_POOL = 9  # a model whose every layer has an 8-token window gives blocks back: it preempts in fewer
# The tiny Gemma 3 (window and global layers, two tables of 2 layers): a 72-token sequence holds 18 blocks
# in its global table and at most 7 in its window table, plus the placeholder. One table would need 36.
HYBRID_POOL = 26


def preempting_pool(config: ModelConfig) -> int:
    """Blocks of 4 tokens for the preempting schedule: too few for every request at once."""
    if config.window_of_every_layer is not None:
        return WINDOWED_POOL
    if plan_kv_groups(config.layer_windows).is_hybrid:
        return HYBRID_POOL
    return SCHEDULES["preempting"][1]


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)


def speculating_engine(loaded, schedule: str, speculative: SpeculativeConfig | None, draft=None) -> EngineCore:
    """`loaded`: a LoadedModel; `draft`: the draft's model, for the draft method."""
    budget, num_blocks = SCHEDULES[schedule]
    if schedule == "preempting":
        num_blocks = preempting_pool(loaded.config)
    return EngineCore(loaded.model, loaded.config, CacheConfig(block_size=4, num_blocks=num_blocks),
                      SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=512),
                      torch.float32, torch.device("cpu"), speculative, draft)  # fmt: skip


def run_waves(
    engine: EngineCore, waves: list[list[list[int]]], params: SamplingParams = GREEDY, tag: str = ""
) -> list[Request]:
    """Each wave's prompts run together, the next wave once they have finished; then one empty step
    tells the runner (and the proposer) which requests ended. Every block is back at the end."""
    done: list[Request] = []
    for wave in waves:
        requests = [Request(f"{tag}{len(done) + i}", p, params) for i, p in enumerate(wave)]
        for r in requests:
            engine.add_request(r)
        while engine.has_unfinished():
            engine.step()
        done += requests
    engine.step()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    return done


def repeating_prompts(seed: int, lengths: tuple[int, ...], repeats: int) -> list[list[int]]:
    """Random prompts, each its first n tokens said `repeats` times (prompt lookup finds them)."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(1, VOCAB, (n,), generator=generator).tolist() * repeats)[: repeats * n] for n in lengths]


def assert_same_greedy(plain: list[Request], speculated: list[Request]) -> None:
    for a, b in zip(plain, speculated, strict=True):
        assert b.output_token_ids == a.output_token_ids
        assert [lp.token_id for lp in b.output_logprobs] == b.output_token_ids
        got, expected = ([lp.logprob for lp in r.output_logprobs] for r in (b, a))
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-4, rtol=0)
