"""EngineArgs: every engine option once, from flags and back to flags, and the configs it builds."""

from __future__ import annotations

import argparse
import inspect
from dataclasses import fields

import pytest
import torch

from folio import LLM
from folio.config import SpeculativeConfig
from folio.engine_args import EngineArgs


def _parse(words: list[str]) -> EngineArgs:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli_args(parser.parse_args(words))


def test_every_llm_keyword_is_an_engine_arg() -> None:
    llm_keywords = [name for name in inspect.signature(LLM.__init__).parameters if name != "self"]
    assert llm_keywords == [f.name for f in fields(EngineArgs)]
    assert EngineArgs("m").llm_kwargs() == {
        name: p.default
        for name, p in inspect.signature(LLM.__init__).parameters.items()
        if name not in ("self", "model")
    }


def test_no_flags_gives_the_defaults() -> None:
    assert _parse(["some-model"]) == EngineArgs("some-model")


@pytest.mark.parametrize(
    "args",
    [
        EngineArgs("m"),
        EngineArgs(
            "a/b.gguf",
            dtype="bfloat16",
            device="cpu",
            kv_cache_memory="2GiB",
            num_kv_blocks=64,
            block_size=32,
            max_num_seqs=4,
            max_num_batched_tokens=256,
            max_model_len=512,
            enable_prefix_caching=False,
            batching="dynamic",
            batch_size=2,
            batch_timeout_ms=12.5,
            quantization="int4",
            kv_cache_dtype="fp8",
            speculative_config=SpeculativeConfig(
                "ngram", 3, prompt_lookup_min=2, prompt_lookup_max=5, disable_by_batch_size=4
            ),
        ),  # fmt: skip
        EngineArgs(
            "m.gguf",
            quantization="none",
            speculative_config=SpeculativeConfig("draft", 6, draft_model="m.gguf", draft_quantization="int8"),
        ),  # fmt: skip
        EngineArgs(
            "m",
            speculative_config=SpeculativeConfig(
                "suffix",
                16,
                suffix_max_tree_depth=32,
                suffix_max_cached_requests=5,
                suffix_max_spec_factor=1.5,
                suffix_min_token_prob=0.25,
            ),
        ),
        EngineArgs(
            "m",
            speculative_config=SpeculativeConfig("lookahead", 5, lookahead_ngram_size=3, lookahead_pool_size=16),
        ),
    ],
)
def test_flags_round_trip(args: EngineArgs) -> None:
    flags = args.to_cli_flags()
    assert _parse([args.model, *flags]) == args
    assert ("--no-prefix-caching" in flags) is not args.enable_prefix_caching


def test_a_torch_dtype_is_written_by_name() -> None:
    assert _parse(["m", *EngineArgs("m", dtype=torch.bfloat16).to_cli_flags()]).dtype == "bfloat16"


def test_the_configs_it_builds() -> None:
    words = "m --kv-cache-memory 1MiB --block-size 8 --no-prefix-caching --kv-cache-dtype int8 --max-num-seqs 3"
    args = _parse([*words.split(), "--batching", "static", "--batch-timeout-ms", "20"])
    cache = args.cache_config()
    assert (cache.block_size, cache.kv_cache_memory, cache.enable_prefix_caching, cache.kv_cache_dtype) == (
        8, 2**20, False, "int8",
    )  # fmt: skip
    scheduler = args.scheduler_config(model_max_len=2048)
    assert (scheduler.max_num_seqs, scheduler.max_model_len, scheduler.batching, scheduler.batch_timeout) == (
        3, 2048, "static", 0.02,
    )  # fmt: skip
    assert EngineArgs("m", max_model_len=100).scheduler_config(model_max_len=2048).max_model_len == 100
